"""QLoRA under memory plans on the CPU: a tiny HF Llama loaded in bitsandbytes nf4 with double
quantisation (``BitsAndBytesConfig``, fp32 compute), LoRA on q,v, AdamW on the adapters.

The profile counts the quantized weights as they are held (packed ``uint8`` data, each block's
absmax and the nested state of double quantisation); planned at 60% and at the named minimum,
with blocks recomputed (their 4-bit matmuls dequantize again) and the head in chunks, the
adapters are bitwise equal to eager's, the 4-bit base is untouched, and the measured peak is
within the budget and 1% of the prediction. Streamed from the host (``stream-weights`` at its
named minimum: every block's packed weights and quantization state in the host pool), the same
holds, and no device copy outlives its window. On a CUDA device (marked ``cuda``: the GPU check
runs it), the same at 60% with bitsandbytes' CUDA kernels.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from adapters_support import IDS, QV, Loop, lora, qlora_llama, relative_error, saved_llama
from superneurons.bench.memory.meter import allocator_peak_bytes
from superneurons.integrations.hf import plan_for_batch
from superneurons.memory import InfeasibleBudgetError, Plan, apply_plan, profile_step
from superneurons.memory.profiling.step import output_loss
from superneurons.memory.profiling.weights import weight_state_tensors

pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

STEPS = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_llama(tmp_path_factory.mktemp("llama"))


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_the_profile_counts_the_quantized_weights_as_held(folder: Path) -> None:
    model = qlora_llama(folder)
    quantized = [p for p in model.parameters() if isinstance(p, bnb.nn.Params4bit)]
    assert quantized and all(p.dtype == torch.uint8 for p in quantized)
    state = weight_state_tensors(model)
    for param in quantized:  # each block's absmax (uint8) and the nested fp32 absmaxes
        held = {id(t) for t in state}
        assert id(param.quant_state.absmax) in held
        assert id(param.quant_state.state2.absmax) in held
    loop = Loop(model)
    profile = profile_step(model, loop.batch, None, output_loss, loop.opt, keep_output=False)
    weights = [*model.parameters(), *model.buffers(), *state]
    assert profile.param_bytes == _storage_bytes(weights)
    assert profile.param_bytes > _storage_bytes([*model.parameters(), *model.buffers()])


def test_qlora_under_plans_is_eager_within_the_budget(folder: Path) -> None:
    loop = Loop(qlora_llama(folder))
    loop.step()
    base = {n: p.detach().clone() for n, p in loop.model.named_parameters() if not p.requires_grad}
    eager = plan_for_batch(
        loop.model, loop.batch, budget_fraction=1.0, optimizer=loop.opt, keep_outputs=False
    ).predicted_peak_bytes
    with pytest.raises(InfeasibleBudgetError) as info:
        plan_for_batch(
            loop.model, loop.batch, budget_bytes=1, optimizer=loop.opt, keep_outputs=False
        )
    for budget, more in ((int(0.6 * eager), 0), (info.value.min_budget_bytes, 1)):
        plan = plan_for_batch(
            loop.model, loop.batch, budget_bytes=budget, optimizer=loop.opt, keep_outputs=False
        )
        with apply_plan(loop.model, plan):
            loop.step()
            peak = allocator_peak_bytes(loop.step, resident=loop.resident)
            for _ in range(more):
                loop.step()
        assert peak <= budget and abs(peak - plan.predicted_peak_bytes) <= 0.01 * peak, budget
    assert plan.count("recompute") > 0 and plan.head is not None  # 4-bit blocks recomputed
    twin = Loop(qlora_llama(folder))
    for _ in range(STEPS):
        twin.step()
    assert loop.count == STEPS
    for (name, a), b in zip(twin.model.named_parameters(), loop.model.parameters(), strict=True):
        assert torch.equal(a, b), f"{name} differs from eager"
        if name in base:
            assert torch.equal(b, base[name]), f"{name} (the 4-bit base) changed"


def _assert_adapters_close(eager: torch.nn.Module, other: torch.nn.Module, *, rel: float) -> None:
    """Trainable parameters within ``rel`` relative error of eager's; frozen ones equal."""
    for (name, a), b in zip(eager.named_parameters(), other.parameters(), strict=True):
        if a.requires_grad:
            assert relative_error(b, a) <= rel, name
        else:
            assert torch.equal(a, b), name


def _fused_adamw(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    # NOTE: fused: the host optimizer steps buckets of the adapters, which the single-tensor
    # loop would round differently from one step over all of them
    return torch.optim.AdamW(list(params), lr=1e-3, fused=True)


def _streaming_floor_plan(loop: Loop) -> Plan:
    """``stream-weights`` at its named minimum (profiled on a shadow of the loop's optimizer:
    the model and the optimizer are untouched)."""
    options = dict(optimizer=loop.opt, keep_outputs=False, strategy="stream-weights")
    with pytest.raises(InfeasibleBudgetError) as info:
        plan_for_batch(loop.model, loop.batch, budget_bytes=1, **options)  # type: ignore[arg-type]
    budget = info.value.min_budget_bytes
    return plan_for_batch(loop.model, loop.batch, budget_bytes=budget, **options)  # type: ignore[arg-type]


def test_qlora_streaming_the_4bit_base_is_eager_within_the_budget(folder: Path) -> None:
    """Every block's nf4 weights (packed data, absmax, the nested state) stream through the
    host pool: adapters bitwise equal to eager's over the steps, the base and its quantization
    state unchanged, the peak within the budget and 1% of the prediction."""
    model = qlora_llama(folder)
    loop = Loop(model)
    loop.opt = _fused_adamw(p for p in model.parameters() if p.requires_grad)
    plan = _streaming_floor_plan(loop)
    layers = [f"base_model.model.model.layers.{i}" for i in range(2)]
    assert set(layers) <= set(plan.streamed_units())
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    state = [t.clone() for t in weight_state_tensors(model)]
    handle = apply_plan(model, plan, optimizer_factory=_fused_adamw)
    assert handle.optimizer is not None and handle.weights is not None
    loop.opt = handle.optimizer  # type: ignore[assignment]  # the host optimizer steps
    stream = handle.weights
    four_bit = [w for w in stream.weights if isinstance(w.param, bnb.nn.Params4bit)]
    packed = [w for w in four_bit if w.owners[0][1] == "data"]
    assert len(packed) == 7 * len(layers)  # every linear layer of every block
    # absmax, nf4 code, offset, the nested absmax and code: each streams with its weight, and
    # between windows the QuantState points at the host copy
    held = {id(w.host) for w in four_bit if w not in packed}
    assert len(held) == 5 * len(packed)
    assert held <= {id(t) for t in weight_state_tensors(model)}
    bound: list[int] = []  # MatMul4Bit nodes following their weight's windows, mid-step
    hook = model.base_model.model.lm_head.register_forward_hook(
        lambda *_: bound.append(sum(len(w.bound) for w in four_bit))
    )
    loop.step()
    host = {id(w.host) for w in stream.weights}
    streamed = {id(w.param) for w in stream.weights}

    def resident() -> list[torch.Tensor]:  # the host optimizer's state and host copies: host
        weights = [*model.parameters(), *model.buffers(), *weight_state_tensors(model)]
        return [t for t in [*weights, IDS] if id(t) not in streamed and id(t) not in host]

    peak = allocator_peak_bytes(loop.step, resident=resident)
    for _ in range(STEPS - 3):
        loop.step()
    hook.remove()
    stats = stream.stats()
    assert stats.device_bytes == 0 and stats.written_back == 0  # no copy outlives its window
    assert min(bound) > 0
    handle.remove()
    assert peak <= plan.budget_bytes
    assert abs(peak - plan.predicted_peak_bytes) <= 0.01 * plan.predicted_peak_bytes
    twin = Loop(qlora_llama(folder))
    twin.opt = _fused_adamw(p for p in twin.model.parameters() if p.requires_grad)
    for _ in range(STEPS):
        twin.step()
    assert loop.count == STEPS
    for (name, a), b in zip(twin.model.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), f"{name} differs from eager"
        if name in base:
            assert torch.equal(b, base[name]), f"{name} (the 4-bit base) changed"
    for before, after in zip(state, weight_state_tensors(model), strict=True):
        assert torch.equal(before, after)  # the quantization state, back on the device


@pytest.mark.cuda
def test_qlora_on_cuda_under_a_plan_is_eager_within_the_budget(folder: Path) -> None:
    """bitsandbytes' CUDA kernels (nf4, double quantisation): planned at 60%, the step's peak
    (``max_memory_allocated``) is within the budget and the adapters equal eager's within 1e-6
    relative (the head's GEMMs over chunks of rows may order sums differently on the GPU)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )  # fmt: skip
    ids = IDS.cuda()
    batch = {"input_ids": ids, "labels": ids}

    def run(planned: bool) -> torch.nn.Module:
        base = AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=quant, device_map="cuda", dtype=torch.float32
        )
        model = lora(base, QV)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

        def step(count: int) -> None:
            torch.manual_seed(count)
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step(0)
        if not planned:
            for count in range(1, 4):
                step(count)
            return model
        eager = plan_for_batch(model, batch, budget_fraction=1.0, optimizer=opt, keep_outputs=False)
        budget = int(0.6 * eager.predicted_peak_bytes)
        plan = plan_for_batch(model, batch, budget_bytes=budget, optimizer=opt, keep_outputs=False)
        with apply_plan(model, plan):
            step(1)
            torch.cuda.reset_peak_memory_stats()
            step(2)
            peak = torch.cuda.max_memory_allocated()
            step(3)
        assert plan.count("recompute") > 0
        assert peak <= budget, (peak, budget)
        return model

    twin, planned = run(planned=False), run(planned=True)
    _assert_adapters_close(twin, planned, rel=1e-6)


@pytest.mark.cuda
def test_qlora_streaming_on_cuda_is_eager_within_the_budget(folder: Path) -> None:
    """bitsandbytes' CUDA kernels with the 4-bit base streamed (``stream-weights`` at its
    floor): the step's peak (``max_memory_allocated``) is within the budget, between steps the
    packed weights and their quantization state are pinned host copies, and the adapters equal
    eager's within 1e-5 relative (the host optimizer's fused AdamW on the CPU against the
    device's kernel: equal within rounding)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )  # fmt: skip
    batch = {"input_ids": IDS.cuda(), "labels": IDS.cuda()}

    def run(streamed: bool) -> torch.nn.Module:
        base = AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=quant, device_map="cuda", dtype=torch.float32
        )
        loop = Loop(lora(base, QV))
        loop.batch = batch
        loop.opt = _fused_adamw(p for p in loop.model.parameters() if p.requires_grad)
        if not streamed:
            for _ in range(4):
                loop.step()
            return loop.model
        plan = _streaming_floor_plan(loop)
        with apply_plan(loop.model, plan, optimizer_factory=_fused_adamw) as handle:
            loop.opt = handle.optimizer  # type: ignore[assignment]
            loop.step()
            torch.cuda.reset_peak_memory_stats()
            loop.step()
            peak = torch.cuda.max_memory_allocated()
            loop.step()
            loop.step()
            packed = [w for w in handle.weights.weights if isinstance(w.param, bnb.nn.Params4bit)]  # type: ignore[union-attr]
            assert packed and all(w.host.is_pinned() for w in packed)
            assert all(w.param.device.type == "cpu" for w in packed if w.owners[0][1] == "data")
        assert peak <= plan.budget_bytes, (peak, plan.budget_bytes)
        return loop.model

    twin, streamed = run(streamed=False), run(streamed=True)
    _assert_adapters_close(twin, streamed, rel=1e-5)
