"""LoRA adapters (PEFT) under memory plans, below the LM head too: a tiny HF Llama with LoRA on
q,v and on all linear layers, AdamW on the adapters, CPU.

Planned at 60% of the eager peak and at the minimum the planner names, the measured peak (the
c10 allocator's view) is within the budget and within 1% of the prediction, the adapters are
bitwise equal to eager's after 8 steps (the chunked head is the unchunked loss's gradient bit
for bit: ``impl="exact"``), the frozen base weights are untouched; only the loss's value is summed
chunk by chunk (within 1e-6 relative). ``below_profiles`` and ``profile_step(fake=True)`` run on
the ``PeftModelForCausalLM`` itself, counting frozen parameters as frozen (no gradient, no
optimizer state).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from adapters_support import ALL_LINEAR, BATCH, QV, SEQ, Loop, lora_llama
from superneurons.bench.memory.meter import allocator_peak_bytes
from superneurons.integrations.hf import plan_for_batch
from superneurons.memory import InfeasibleBudgetError, apply_plan, below_profiles, profile_step
from superneurons.memory.planner.decide import min_peak_bytes
from superneurons.memory.profiling.step import output_loss

pytest.importorskip("peft")
pytest.importorskip("transformers")

STEPS = 8
HEAD = "base_model.model.lm_head"  # the output embedding, inside PEFT's two wrappers


def _named_minimum(loop: Loop, **options: Any) -> int:
    """The minimum ``plan_for_batch`` names for a budget no plan reaches."""
    with pytest.raises(InfeasibleBudgetError) as info:
        plan_for_batch(loop.model, loop.batch, budget_bytes=1, optimizer=loop.opt, **options)
    return info.value.min_budget_bytes


def _planned_steps(loop: Loop, budget: int, *, steps: int = 0) -> tuple[Any, int]:
    """Plan ``loop`` at ``budget``, run a step, meter one (the meter runs two), then ``steps``
    more: the plan and the measured peak."""
    plan = plan_for_batch(
        loop.model, loop.batch, budget_bytes=budget, optimizer=loop.opt,
        keep_outputs=loop.keep_outputs,
    )  # fmt: skip
    with apply_plan(loop.model, plan):
        loop.step()
        peak = allocator_peak_bytes(loop.step, resident=loop.resident)
        for _ in range(steps):
            loop.step()
    return plan, peak


@pytest.mark.parametrize("targets", [QV, ALL_LINEAR], ids=["qv", "all-linear"])
def test_lora_under_plans_is_eager_within_the_budget(targets: Any) -> None:
    loop = Loop(lora_llama(targets))
    loop.step()  # AdamW's moments exist, as in the profiled steady state
    frozen = {
        n: p.detach().clone() for n, p in loop.model.named_parameters() if not p.requires_grad
    }
    eager = plan_for_batch(
        loop.model, loop.batch, budget_fraction=1.0, optimizer=loop.opt, keep_outputs=False
    ).predicted_peak_bytes
    floor = _named_minimum(loop, keep_outputs=False)
    assert floor < _named_minimum(loop, keep_outputs=False, below=False)  # the head was binding
    for budget, more in ((int(0.6 * eager), 0), (floor, 1)):  # 1 + 3 + 4 = 8 steps
        plan, peak = _planned_steps(loop, budget, steps=more)
        where = f"{plan.strategy} at {budget} B ({budget / eager:.0%} of eager)"
        assert peak <= budget, f"{where}: measured {peak} B"
        assert abs(peak - plan.predicted_peak_bytes) <= 0.01 * peak, where
    assert plan.head is not None and plan.head.fqn == HEAD and plan.head.impl == "exact"
    twin = Loop(lora_llama(targets))
    for _ in range(STEPS):
        twin.step()
    assert loop.count == STEPS
    for (name, a), b in zip(twin.model.named_parameters(), loop.model.parameters(), strict=True):
        assert torch.equal(a, b), f"{name} differs from eager"
        if not a.requires_grad:
            assert torch.equal(b, frozen[name]), f"{name} (frozen) changed"
    for got, expected in zip(loop.losses, twin.losses, strict=True):
        assert abs(got - expected) <= 1e-6 * abs(expected)  # the loss's sum, chunk by chunk


@pytest.mark.parametrize("task_type", ["CAUSAL_LM", None])  # PeftModelForCausalLM, PeftModel
def test_below_profiles_and_fake_profiles_run_on_the_peft_model(task_type: str | None) -> None:
    model = lora_llama(QV, task_type)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    batch = Loop(model).batch
    real = profile_step(model, batch, None, output_loss, opt, keep_output=False)
    fake = profile_step(model, batch, None, output_loss, opt, keep_output=False, fake=True)
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    for profile in (real, fake):  # frozen parameters: no gradient, no optimizer state
        assert profile.grad_bytes == trainable_bytes
        weights = [*model.parameters(), *model.buffers()]
        assert profile.param_bytes == sum(t.numel() * t.element_size() for t in weights)
    assert fake.optimizer_state_bytes == real.optimizer_state_bytes
    chunked = below_profiles(
        model, batch, None, output_loss, opt, profile=real, tokens=BATCH * SEQ, seq_len=SEQ,
        keep_output=False,
    )  # fmt: skip
    assert chunked and {p.head.fqn for p in chunked if p.head} == {HEAD}
    assert min_peak_bytes(real, chunked=chunked)["recompute"] < min_peak_bytes(real)["recompute"]


def test_a_loop_that_keeps_its_outputs_stays_within_the_default_plan() -> None:
    """HF's ``no_trainer`` loop keeps ``outputs`` (the logits) through backward: planned with
    the defaults, at 60% and at the named minimum, it stays within the budget."""
    loop = Loop(lora_llama(QV), keep_outputs=True)
    loop.step()
    eager = plan_for_batch(loop.model, loop.batch, budget_fraction=1.0, optimizer=loop.opt)
    floor = _named_minimum(loop)
    for budget in (int(0.6 * eager.predicted_peak_bytes), floor):
        plan, peak = _planned_steps(loop, budget)
        assert peak <= budget, f"{budget / eager.predicted_peak_bytes:.0%}: measured {peak} B"


def test_the_minimum_a_plan_names_is_one_the_same_call_reaches() -> None:
    """On a CPU device ``auto`` plans recompute: the minimum named is recompute's, not that
    of a strategy the call would never run."""
    loop = Loop(lora_llama(QV))
    loop.step()
    plan = plan_for_batch(
        loop.model, loop.batch, budget_fraction=0.9, optimizer=loop.opt, keep_outputs=False
    )
    again = plan_for_batch(
        loop.model, loop.batch, budget_bytes=plan.min_budget_bytes, optimizer=loop.opt,
        keep_outputs=False,
    )  # fmt: skip
    assert again.strategy == plan.strategy == "recompute"
    assert again.predicted_peak_bytes <= plan.min_budget_bytes


def test_prepare_superneurons_plans_a_peft_model_and_gives_it_back() -> None:
    """Accelerate: a LoRA model with HF's checkpointing on (as TRL sets it) is planned below
    its head, trains as eager, and gets its checkpointing back from ``setup.remove()``."""
    import warnings

    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from superneurons.integrations.accelerate import prepare_superneurons

    def checkpointing(model: torch.nn.Module) -> bool:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return bool(model.is_gradient_checkpointing)

    loop = Loop(lora_llama(QV))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        loop.model.gradient_checkpointing_enable()
    loop.step()
    setup = prepare_superneurons(
        Accelerator(cpu=True), loop.model, sample_batch=loop.batch, optimizer=loop.opt,
        budget_fraction=0.5,
    )  # fmt: skip
    assert setup.plan is not None and setup.plan.head is not None
    assert not checkpointing(loop.model)  # the plan recomputes instead
    for _ in range(2):
        loop.step()
    setup.remove()
    assert checkpointing(loop.model)
    assert all("forward" not in vars(m) for m in loop.model.modules())
    twin = Loop(lora_llama(QV))
    for _ in range(3):
        twin.step()
    for a, b in zip(twin.model.parameters(), loop.model.parameters(), strict=True):
        assert torch.equal(a, b)
