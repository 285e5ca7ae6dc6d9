"""Fake-tensor simulation: zoo profiles without memory, and the affine depth / batch search."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from superneurons.bench.search import max_fitting
from superneurons.errors import ConfigError
from superneurons.memory.planner import make_plan, min_peak_bytes
from superneurons.memory.predict import evaluate
from superneurons.memory.profile import profile_step
from superneurons.memory.simulate import profile_zoo, simulate_plan


def _peaks(n: int) -> dict[str, int]:
    profile = profile_zoo("resnet", batch_size=8, layers=(1, 1, n, 1), image_size=128)
    return min_peak_bytes(profile)


def test_depth_search_matches_direct_profiles() -> None:
    strategies = ("eager", "checkpoint")
    probe = _peaks(5)
    budget = (probe["eager"] + probe["checkpoint"]) // 2
    fits = max_fitting(_peaks, strategies, budget_bytes=budget, sizes=(2, 3, 4))
    for strategy, fit in fits.items():
        assert fit.residual < 0.01  # identical blocks: the peak is affine in n
        predicted = fit.intercept_bytes + fit.slope_bytes * 5
        assert abs(predicted - probe[strategy]) <= 0.01 * probe[strategy]
    assert fits["checkpoint"].size > fits["eager"].size  # recompute goes deeper
    eager_n = fits["eager"].size
    assert _peaks(eager_n)["eager"] <= budget < _peaks(eager_n + 1)["eager"]


def test_profile_zoo_uses_no_real_memory_and_counts_optimizer_state() -> None:
    sgd = profile_zoo("resnet", batch_size=2, layers=(1, 1, 1, 1), image_size=32)
    adam = profile_zoo(
        "resnet", batch_size=2, layers=(1, 1, 1, 1), image_size=32, optimizer="adamw"
    )
    assert sgd.fake and sgd.optimizer_state_bytes > 0
    assert adam.optimizer_state_bytes >= 2 * sgd.optimizer_state_bytes  # exp_avg + exp_avg_sq
    with pytest.raises(ConfigError, match="optimizer"):
        profile_zoo("resnet", batch_size=2, optimizer="lion")


def test_bad_budget_rejected() -> None:
    with pytest.raises(ConfigError, match="positive"):
        max_fitting(lambda n: {"eager": n}, ("eager",), budget_bytes=0, sizes=(1, 2, 3))


def _chain(depth: int = 9, width: int = 16) -> nn.Sequential:
    blocks = [
        nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        for _ in range(depth)
    ]
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.Sequential(*blocks),
        nn.Flatten(),
        nn.Linear(width * 16 * 16, 10),
    )


_STRATEGIES = ("eager", "checkpoint", "recompute", "offload", "offload+opt-in-backward")


@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_executed_plan_peak_matches_prediction(strategy: str) -> None:
    model = _chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    loss_fn = nn.functional.cross_entropy
    profile = profile_step(model, x, y, loss_fn, opt, fake=True)
    budget = min_peak_bytes(profile)[strategy]
    plan = make_plan(profile, budget_bytes=budget, strategy=strategy)
    measured = simulate_plan(model, x, y, loss_fn, opt, plan).measured_peak_bytes
    predicted = plan.predicted_peak_bytes
    assert predicted <= budget
    assert measured <= budget  # the step executed by the runtime's own code
    if strategy.startswith("offload"):
        # the recompute+offload model is still conservative on these 16-channel toy blocks
        # (conv, BN, ReLU units): measured up to 11% below the prediction, never above it
        # (exact on ResNet-50, GPT and the demo's ResNet)
        assert measured <= predicted <= 1.12 * measured
    else:
        assert abs(predicted - measured) <= 0.01 * measured  # the executed step, within 1%
    if strategy == "recompute":
        assert any(u.segment >= 0 for u in plan.units)  # memory-centric segments were used


def test_verify_corrects_a_non_affine_fit() -> None:
    def peaks(n: int) -> dict[str, int]:
        return {"eager": n * n}  # convex: the affine fit through 2 and 3 overshoots

    budget = 200
    fitted = max_fitting(peaks, ("eager",), budget_bytes=budget, sizes=(1, 2, 3))
    verified = max_fitting(peaks, ("eager",), budget_bytes=budget, sizes=(1, 2, 3), verify=True)
    assert fitted["eager"].size > 14 and verified["eager"].size == 14  # 14^2 <= 200 < 15^2


_UNDER = pytest.mark.xfail(
    strict=True,
    reason="known bug: on these conv-BN-ReLU blocks an offloaded unit followed by a "
    "recompute+offload unit is under-predicted by one activation (7.3%); the same pair of "
    "ResNet basic blocks is predicted exactly",
)


@pytest.mark.parametrize("first", ["offload", "recompute+offload", "recompute"])
@pytest.mark.parametrize(
    "second",
    ["offload", "recompute+offload", "recompute"],
)
def test_two_planned_neighbours_predicted_exactly(
    first: str, second: str, request: pytest.FixtureRequest
) -> None:
    if (first, second) == ("offload", "recompute+offload"):
        request.applymarker(_UNDER)
    # an offloaded unit followed by a recompute+offload one was over-predicted by one
    # activation: its prefetch was placed on the neighbour's recompute spike, while the runtime
    # issues it once that recompute is over
    model = _chain(depth=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    loss_fn = nn.functional.cross_entropy
    profile = profile_step(model, x, y, loss_fn, opt, fake=True)
    base = make_plan(profile, budget_bytes=10**12, strategy="eager")
    actions = {"1.1": first, "1.2": second}
    units = tuple(
        dataclasses.replace(u, action=actions.get(u.fqn, "keep"), segment=-1) for u in base.units
    )
    assert {u.fqn for u in units} >= set(actions), [u.fqn for u in units]
    predicted = evaluate(profile, {u.fqn: u.action for u in units}).peak_bytes
    plan = dataclasses.replace(base, units=units)
    assert simulate_plan(model, x, y, loss_fn, opt, plan).measured_peak_bytes == predicted
