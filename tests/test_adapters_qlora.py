"""QLoRA under memory plans on the CPU: a tiny HF Llama loaded in bitsandbytes nf4 with double
quantisation (``BitsAndBytesConfig``, fp32 compute), LoRA on q,v, AdamW on the adapters.

The profile counts the quantized weights as they are held (packed ``uint8`` data, each block's
absmax and the nested state of double quantisation); planned at 60% and at the named minimum,
with blocks recomputed (their 4-bit matmuls dequantize again) and the head in chunks, the
adapters are bitwise equal to eager's, the 4-bit base is untouched, and the measured peak is
within the budget and 1% of the prediction.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adapters_support import Loop, qlora_llama, saved_llama
from superneurons.bench.memory.meter import allocator_peak_bytes
from superneurons.integrations.hf import plan_for_batch
from superneurons.memory import InfeasibleBudgetError, apply_plan, profile_step
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
