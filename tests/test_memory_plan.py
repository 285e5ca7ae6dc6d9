"""make_plan: budgets respected, monotone, JSON round trip, infeasible budgets, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import superneurons.memory.plan as plan_module
from superneurons.bytesize import parse_bytes
from superneurons.errors import ConfigError
from superneurons.memory.plan import InfeasibleBudgetError, Plan, UnitDecision
from superneurons.memory.planner.decide import make_plan, min_peak_bytes
from superneurons.memory.profile_types import Profile
from superneurons.memory.profiling.step import profile_step


def _chain(depth: int = 6, width: int = 16) -> nn.Sequential:
    blocks = [
        nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        for _ in range(depth)
    ]
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.Sequential(*blocks),
        nn.Flatten(),
        nn.Linear(width * 8 * 8, 10),
    )


@pytest.fixture(scope="module")
def profile() -> Profile:
    torch.manual_seed(0)
    model = _chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    return profile_step(model, x, y, nn.functional.cross_entropy, opt, fake=True)


STRATEGIES = (
    "eager",
    "checkpoint",
    "recompute",
    "offload",
    "offload+opt-in-backward",
    "offload+opt-on-host",
    "auto",
)


def _budgets(profile: Profile) -> list[int]:
    low = min(min_peak_bytes(profile).values())
    high = profile.predicted_peak_bytes()
    return [int(low + (high - low) * i / 12) for i in range(13)] + [2 * high]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_peak_within_budget_and_monotone(profile: Profile, strategy: str) -> None:
    peaks = []
    for budget in sorted(_budgets(profile), reverse=True):
        try:
            plan = make_plan(profile, budget_bytes=budget, strategy=strategy)
        except InfeasibleBudgetError:
            continue
        assert plan.feasible and plan.predicted_peak_bytes <= budget
        assert len(plan.tensors) == len(profile.saved)
        peaks.append(plan.predicted_peak_bytes)
    assert peaks, "no budget was feasible"
    assert all(b <= a for a, b in zip(peaks, peaks[1:], strict=False))  # falls with the budget


def test_planning_saves_memory_and_costs(profile: Profile) -> None:
    eager = profile.predicted_peak_bytes()
    minima = min_peak_bytes(profile)
    assert minima["eager"] == eager
    assert minima["checkpoint"] < eager and minima["offload"] <= minima["checkpoint"]
    plan = make_plan(profile, budget_bytes=minima["offload"], strategy="offload")
    moved = plan.count("offload") + plan.count("recompute+offload")
    assert plan.host_bytes > 0 and plan.transfer_s > 0 and moved > 0
    plan = make_plan(profile, budget_bytes=minima["recompute"], strategy="recompute")
    assert plan.extra_compute_s > 0 and plan.host_bytes == 0 and plan.count("offload") == 0


def test_auto_keeps_everything_when_it_fits(profile: Profile) -> None:
    plan = make_plan(profile, budget_bytes=2 * profile.predicted_peak_bytes())
    assert plan.count("keep") == len(profile.units) and plan.extra_compute_s == 0


def test_json_round_trip(profile: Profile) -> None:
    budget = min_peak_bytes(profile)["offload"]
    plan = make_plan(profile, budget_bytes=budget, strategy="offload")
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.version == plan.version


def test_infeasible_budget_names_the_minimum(profile: Profile) -> None:
    minimum = min(min_peak_bytes(profile).values())
    with pytest.raises(InfeasibleBudgetError, match=str(minimum)) as info:
        make_plan(profile, budget_bytes=minimum - 1)
    assert info.value.min_budget_bytes == minimum
    assert isinstance(info.value, ConfigError) and info.value.strategy in plan_module.STRATEGIES


@pytest.mark.parametrize("strategy", ["recompute", "checkpoint", "offload"])
def test_a_strategy_asked_for_names_a_minimum_it_reaches(profile: Profile, strategy: str) -> None:
    """The minimum named is the strategy's own floor (another strategy's, lower, is advice in
    the message only): the same call with that budget plans."""
    floor = min_peak_bytes(profile)[strategy]
    with pytest.raises(InfeasibleBudgetError) as info:
        make_plan(profile, budget_bytes=floor - 1, strategy=strategy)
    assert info.value.min_budget_bytes == floor and info.value.strategy == strategy
    plan = make_plan(profile, budget_bytes=floor, strategy=strategy)
    assert plan.min_budget_bytes == floor and plan.predicted_peak_bytes <= floor


@pytest.mark.parametrize("text", ["twelve gigs", "12XB", "", "0", "-5GiB", "0GiB"])
def test_bad_budget_strings(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_bytes(text)


@pytest.mark.parametrize("budget", [0, -1])
def test_bad_budget_values(profile: Profile, budget: int) -> None:
    with pytest.raises(ConfigError, match="positive"):
        make_plan(profile, budget_bytes=budget)


def test_bad_strategy_and_plan_fields(profile: Profile) -> None:
    with pytest.raises(ConfigError, match="strategy"):
        make_plan(profile, budget_bytes=10**9, strategy="magic")
    with pytest.raises(ConfigError, match="action"):
        UnitDecision("blocks.0", "teleport")
    with pytest.raises(ConfigError, match="version"):
        Plan(units=(), strategy="eager", budget_bytes=1, version=99)
    with pytest.raises(ConfigError):
        Plan.from_json("[1, 2]")


def test_disallowing_optimizer_in_backward_limits_auto_and_the_named_minimum() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(6)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    inputs, targets = torch.randn(128, 64), torch.randn(128, 64)
    profile = profile_step(model, inputs, targets, nn.functional.mse_loss, optimizer)
    minima = min_peak_bytes(profile)
    in_backward = ("offload+opt-in-backward", "offload+opt-on-host")
    without = min(v for k, v in minima.items() if k not in in_backward)
    with pytest.raises(InfeasibleBudgetError) as info:
        make_plan(profile, budget_bytes=without - 1, allow_optimizer_in_backward=False)
    assert info.value.min_budget_bytes == without
    plan = make_plan(profile, budget_bytes=without, allow_optimizer_in_backward=False)
    assert not plan.optimizer_in_backward and plan.predicted_peak_bytes <= without
    with pytest.raises(ConfigError):
        make_plan(
            profile,
            budget_bytes=without,
            strategy="offload+opt-in-backward",
            allow_optimizer_in_backward=False,
        )
