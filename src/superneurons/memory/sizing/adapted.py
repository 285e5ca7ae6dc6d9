"""A causal LM built on fake tensors, adapted as PEFT and bitsandbytes adapt it for training:
``plan --lora`` (LoRA on the base's linear layers, the base frozen) and ``--quantize`` (the
frozen linear layers at bitsandbytes' storage: :mod:`.quantized`).

:func:`adapt` changes the fake model in place, in the order a QLoRA script runs:

1. ``--quantize``: every ``nn.Linear`` but the output embedding becomes a quantized stand-in, as
   transformers' ``replace_with_bnb_linear`` converts them (``get_keys_to_not_convert`` keeps
   the output embedding, tied or not, in the model's dtype);
2. LoRA: PEFT's own injection (``peft.inject_adapter_in_model``, the code ``get_peft_model``
   runs: ``LoraModel.inject_adapter``) wraps each target in PEFT's LoRA layer (``lora.Linear``,
   or ``lora.bnb.Linear4bit`` / ``Linear8bitLt`` around a stand-in) and freezes everything but
   the adapters. It runs with ``low_cpu_mem_usage`` (adapters on ``meta``: PEFT's ``.to()`` of
   a fake module fails), and the adapters are then made fake tensors of the dtype PEFT gives
   them (:data:`~superneurons.memory.sizing.adapters.LoraSpec` ``dtype``).

The result is the inner model of ``get_peft_model(model, config).base_model.model``: its
forward is PEFT's, so what LoRA saves (the input cast to the adapters' dtype, the dropout mask,
``A x``) is what PEFT's forward saves, and the chunked LM head applies as to a full fine-tune.

Not modelled: ``prepare_model_for_kbit_training`` (which casts the non-quantized parameters,
the embeddings and the LM head included, to fp32), bitsandbytes' 8-bit optimizers, and adapters
other than LoRA (DoRA, ...).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory.chunked.adapter_inputs import base_compute_dtype
from superneurons.memory.sizing.adapters import LoraSpec, QuantSpec
from superneurons.memory.sizing.quantized import quantized_linear

__all__ = ["adapt"]

logger = logging.getLogger("superneurons.memory")


def adapt(
    model: nn.Module,
    lora: LoraSpec,
    quantize: QuantSpec | None,
    *,
    mode: Any,
    compute: torch.dtype,
    target_device: str,
) -> nn.Module:
    """Quantize ``model``'s linear layers (``quantize``) and inject LoRA adapters (``lora``),
    in place, on the fake tensors of ``mode``; ``compute``: the dtype the quantized layers
    compute in. Returns ``model``.

    Raises:
        ConfigError: PEFT (or, with ``quantize``, bitsandbytes) is not installed, or no module
            matches ``lora.targets``.
    """
    if quantize is not None:
        with mode:
            count = _quantize_linears(model, quantize, compute, target_device)
        if not count:
            raise ConfigError(
                "--quantize converts nn.Linear layers and this model has none besides its head"
            )
    _inject_lora(model, lora, loaded_in=None if quantize is None else quantize.kind)
    with mode:
        _materialize(model, lora)
    return model


def _quantize_linears(
    model: nn.Module, quantize: QuantSpec, compute: torch.dtype, target_device: str
) -> int:
    head = _output_embedding(model)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child is not head:
                layer = quantized_linear(
                    child, quantize.kind, double_quant=quantize.double_quant,
                    blocksize=quantize.blocksize, compute=compute, target_device=target_device,
                )  # fmt: skip
                setattr(parent, name, layer)
                replaced += 1
    return replaced


def _output_embedding(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:  # an optional dependency
        raise ConfigError("--lora models PEFT's adapters: pip install peft") from exc
    return peft


@contextlib.contextmanager
def _loaded_in(model: nn.Module, kind: str | None) -> Iterator[None]:
    """``model.is_loaded_in_4bit`` / ``_8bit`` while PEFT injects: how PEFT learns that the
    base is quantized (``LoraModel._create_and_replace``), and how transformers marks it."""
    flag = {"nf4": "is_loaded_in_4bit", "int8": "is_loaded_in_8bit"}.get(kind or "")
    if flag is None:
        yield
        return
    had = flag in vars(model)
    previous = vars(model).get(flag)
    setattr(model, flag, True)
    try:
        yield
    finally:
        if had:
            setattr(model, flag, previous)
        else:
            delattr(model, flag)


def _inject_lora(model: nn.Module, lora: LoraSpec, *, loaded_in: str | None) -> None:
    peft = _peft()
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        bias="none",
    )
    with _loaded_in(model, loaded_in), _quiet_peft():
        try:
            peft.inject_adapter_in_model(config, model, low_cpu_mem_usage=True)
        except ValueError as exc:  # PEFT: "Target modules {...} not found in the base model"
            names = sorted(
                {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
            )
            raise ConfigError(
                f"--lora targets={','.join(lora.targets)} matches no layer PEFT can adapt; this "
                f"model's linear layers are named {', '.join(names)} (or use all-linear)"
            ) from exc


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    """PEFT's warnings (``warnings.warn``) off while it injects: the profile is no training."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _materialize(model: nn.Module, lora: LoraSpec) -> None:
    """The adapters PEFT left on ``meta`` as fake tensors of the dtype PEFT gives them: fp32
    (``get_peft_model``'s ``autocast_adapter_dtype=True``) or the base layer's dtype, its
    compute dtype for a quantized one (``BaseTunerLayer._get_base_layer_device_and_dtype``)."""
    peft = _peft()
    for layer in model.modules():
        if not isinstance(layer, peft.tuners.tuners_utils.BaseTunerLayer):
            continue
        dtype = torch.float32 if lora.dtype == "fp32" else _base_dtype(layer.get_base_layer())
        for module in layer.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and param.device.type == "meta":
                    fake = torch.empty(param.shape, dtype=dtype)
                    module._parameters[name] = nn.Parameter(fake, requires_grad=param.requires_grad)


def _base_dtype(base: nn.Module) -> torch.dtype:
    # PEFT never casts adapters to an integer dtype (int8 weights): they stay as created
    return base_compute_dtype(base) or torch.get_default_dtype()
