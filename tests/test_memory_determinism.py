"""Reproducible plans: the same profile gives the same plan, and the same model and batch
profiled and planned again in one process gives the same plan, whatever the timing noise
(``CostModel.unit_seconds``: the median time of same-shape units on a quarter-octave grid)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from superneurons.memory.plan import Plan
from superneurons.memory.planner.decide import make_plan
from superneurons.memory.profile_types import Profile
from superneurons.memory.profiling.step import output_loss, profile_step

transformers = pytest.importorskip("transformers")


def _model_and_batch() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    config = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=172, vocab_size=512, max_position_embeddings=128, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def _decisions(plan: Plan) -> tuple[tuple[str, str, int], ...]:
    return tuple((u.fqn, u.action, u.segment) for u in plan.units)


def _plan(profile: Profile) -> Plan:
    eager = profile.predicted_peak_bytes()
    floor = make_plan(
        profile, budget_bytes=eager, allow_optimizer_in_backward=False
    ).min_budget_bytes
    budget = (eager + floor) // 2  # a plan that must choose some units, not all
    return make_plan(profile, budget_bytes=budget, allow_optimizer_in_backward=False)


def test_the_same_call_twice_gives_the_same_plan() -> None:
    model, batch = _model_and_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plans = {
        _decisions(_plan(profile_step(model, batch, None, output_loss, opt, keep_output=False)))
        for _ in range(6)
    }
    assert len(plans) == 1, plans


def test_timing_noise_does_not_change_the_plan() -> None:
    model, batch = _model_and_batch()
    profile = profile_step(model, batch, None, output_loss, None, keep_output=False)
    reference = _decisions(_plan(profile))
    assert any(action != "keep" for _, action, _ in reference)
    rng = random.Random(0)
    for _ in range(20):
        noisy = dataclasses.replace(
            profile,
            units=tuple(
                dataclasses.replace(u, fwd_time_s=u.fwd_time_s * rng.uniform(0.7, 1.3))
                for u in profile.units
            ),
        )
        assert _decisions(_plan(noisy)) == reference


def test_the_same_profile_gives_the_same_plan() -> None:
    model, batch = _model_and_batch()
    profile = profile_step(model, batch, None, output_loss, None, keep_output=False)
    assert len({_decisions(_plan(profile)) for _ in range(5)}) == 1


def test_every_unit_a_plan_moves_off_keep_is_needed() -> None:
    """Minimal plans: taking any one unit of the plan back to "keep" breaks the budget, whatever
    order timing noise gives the candidates (a unit that entered the greedy prefix early and
    ended up lowering nothing is taken back), so noise cannot add a useless unit to a plan."""
    from superneurons.memory.planner.cost import CostModel
    from superneurons.memory.planner.predict import evaluate

    model, batch = _model_and_batch()
    profile = profile_step(model, batch, None, output_loss, None, keep_output=False)
    rng = random.Random(1)
    for _ in range(10):
        noisy = dataclasses.replace(
            profile,
            units=tuple(
                dataclasses.replace(u, fwd_time_s=u.fwd_time_s * rng.uniform(0.1, 10.0))
                for u in profile.units
            ),
        )
        plan = _plan(noisy)
        actions = {u.fqn: u.action for u in plan.units}
        moved = [fqn for fqn, action in actions.items() if action != "keep"]
        assert moved
        for fqn in moved:
            back = {**actions, fqn: "keep"}
            peak = evaluate(noisy, back, cost=CostModel()).peak_bytes
            assert peak > plan.budget_bytes, f"{fqn} is not needed: {peak} <= {plan.budget_bytes}"
