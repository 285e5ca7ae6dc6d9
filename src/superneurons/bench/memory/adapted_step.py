"""A real LoRA / QLoRA training step on the CPU, built as PEFT and bitsandbytes build it: the
measurement ``plan --lora`` / ``--quantize`` is checked against (``tests/test_memory_llm.py``,
``benchmarks/llm_plan.py``).

:func:`adapted_model` quantizes every linear layer but the output embedding with bitsandbytes'
own modules (``Linear4bit`` with ``Params4bit``, ``Linear8bitLt`` with ``Int8Params``: moving
them to the CPU quantizes them, as transformers' loader does), marks the model
``is_loaded_in_4bit`` / ``_8bit`` as transformers does, and wraps it with
``peft.get_peft_model``. :func:`measured_peak_bytes` runs ``outputs = model(**batch);
outputs.loss.backward(); opt.step()`` (HF's ``no_trainer`` loop, AdamW over the trainable
parameters) and returns the c10 allocator's peak (:mod:`.meter`), counting the quantization
state bitsandbytes keeps outside parameters and buffers as resident.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from superneurons.bench.memory.meter import allocator_peak_bytes
from superneurons.memory import Plan, apply_plan
from superneurons.memory.sizing.adapters import LoraSpec, QuantSpec

__all__ = ["adapted_model", "measured_peak_bytes", "quant_state_tensors"]


def adapted_model(
    model: nn.Module, lora: LoraSpec, quantize: QuantSpec | None, *, compute: torch.dtype
) -> nn.Module:
    """``get_peft_model(model quantized as ``quantize``, LoraConfig(...))`` in training mode;
    ``compute``: the quantized layers' ``compute_dtype``. Changes ``model`` in place."""
    import peft

    if quantize is not None:
        _quantize(model, quantize, compute)
        flag = "is_loaded_in_4bit" if quantize.kind == "nf4" else "is_loaded_in_8bit"
        setattr(model, flag, True)
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        bias="none",
    )
    wrapped = peft.get_peft_model(model, config, autocast_adapter_dtype=lora.dtype == "fp32")
    return wrapped.train()  # type: ignore[no-any-return]


def _quantize(model: nn.Module, quantize: QuantSpec, compute: torch.dtype) -> None:
    import bitsandbytes as bnb

    head = model.get_output_embeddings()  # type: ignore[operator]
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child is head:
                continue
            bias = child.bias is not None
            layer: nn.Module
            if quantize.kind == "nf4":
                layer = bnb.nn.Linear4bit(
                    child.in_features, child.out_features, bias=bias, compute_dtype=compute,
                    compress_statistics=quantize.double_quant, quant_type="nf4",
                )  # fmt: skip
                layer.weight = bnb.nn.Params4bit(
                    child.weight.data, requires_grad=False, blocksize=quantize.blocksize,
                    compress_statistics=quantize.double_quant, quant_type="nf4", module=layer,
                )  # fmt: skip
            else:
                layer = bnb.nn.Linear8bitLt(
                    child.in_features, child.out_features, bias=bias, has_fp16_weights=False,
                    threshold=0.0,
                )  # fmt: skip
                layer.weight = bnb.nn.Int8Params(
                    child.weight.data, requires_grad=False, has_fp16_weights=False
                )
            if bias:
                layer.bias = nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, layer.to("cpu"))  # moving it quantizes it


def quant_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors bitsandbytes keeps outside parameters and buffers: a ``Linear4bit``'s
    ``QuantState`` (absmax, codes, offset, the second level's), a ``Linear8bitLt``'s row
    scales (``SCB``)."""
    import bitsandbytes as bnb

    found: list[Any] = []
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state: Any = getattr(module.weight, "quant_state", None)
            found += [state.absmax, state.code, state.offset]
            if state.state2 is not None:
                found += [state.state2.absmax, state.state2.code]
        elif isinstance(module, bnb.nn.Linear8bitLt):
            found += [module.state.CB, module.state.SCB, getattr(module.weight, "SCB", None)]
    return [t for t in found if isinstance(t, torch.Tensor)]


def measured_peak_bytes(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    plan: Plan | None = None,
    on_apply: Callable[[int], None] | None = None,
) -> int:
    """The c10 allocator's peak over a steady-state step of HF's ``no_trainer`` loop (the
    outputs live until the next step replaces them), AdamW over the trainable parameters.

    With ``plan`` (made for the model ``get_peft_model`` wraps: ``model.base_model.model``),
    the step runs under it, its optimizer the plan's (the host optimizer where the plan has
    one); what the plan keeps on the host (the host optimizer's state, streamed weights' host
    copies) is not counted as resident: on the CPU the host is the same memory, so the host
    optimizer's own allocations during its step are counted (an upper bound of the device's).
    ``on_apply`` is told the host bytes of the weights the plan streams, once it is applied.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    handle = None
    if plan is not None:
        inner: nn.Module = model.base_model.model  # type: ignore[assignment,union-attr]
        handle = apply_plan(
            inner, plan, optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=1e-4)
        )
        if on_apply is not None:
            on_apply(handle.weights.host_bytes() if handle.weights is not None else 0)
    opt: Any = (
        handle.optimizer
        if handle is not None and handle.optimizer is not None
        else torch.optim.AdamW(trainable, lr=1e-4)  # the cpu default: single tensor
    )
    state: dict[str, Any] = {}

    def step() -> None:
        state["outputs"] = model(**batch)
        state["outputs"].loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def resident() -> list[torch.Tensor]:
        kept = [v for v in state["outputs"].values() if torch.is_tensor(v)]
        optimizer = (
            [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
            if handle is None or handle.optimizer is None
            else []
        )
        inputs = list(batch.values())
        quantized = quant_state_tensors(model)
        weights = [*model.parameters(), *model.buffers(), *quantized]
        if handle is not None and handle.weights is not None:
            host = {id(w.host) for w in handle.weights.weights}
            streamed = {id(w.param) for w in handle.weights.weights}
            weights = [t for t in weights if id(t) not in host and id(t) not in streamed]
        return [*weights, *optimizer, *inputs, *kept]

    try:
        step()
        return allocator_peak_bytes(step, resident=resident)
    finally:
        if handle is not None:
            handle.remove()
