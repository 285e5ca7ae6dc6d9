"""QLoRA under memory plans on the CPU: a tiny HF Llama loaded in bitsandbytes nf4 with double
quantisation (``BitsAndBytesConfig``, fp32 compute), LoRA on q,v, AdamW on the adapters.

The profile counts the quantized weights as they are held (packed ``uint8`` data, each block's
absmax and the nested state of double quantisation); planned at 60% and at the named minimum,
with blocks recomputed (their 4-bit matmuls dequantize again) and the head in chunks, the
adapters are bitwise equal to eager's, the 4-bit base is untouched, and the measured peak is
within the budget and 1% of the prediction. On a CUDA device (marked ``cuda``: the GPU check
runs it), the same at 60% with bitsandbytes' CUDA kernels.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adapters_support import IDS, QV, Loop, lora, qlora_llama, relative_error, saved_llama
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
    for (name, a), b in zip(twin.named_parameters(), planned.parameters(), strict=True):
        if a.requires_grad:
            assert relative_error(b, a) <= 1e-6, name
        else:
            assert torch.equal(a, b), name
