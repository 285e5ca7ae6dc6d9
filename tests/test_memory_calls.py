"""A module called several times in one forward (a bottleneck's one ``ReLU``, three calls) is
modelled call by call: each call's saved tensors leave at the end of that call and come back
in that call's backward, as the runtime's pool groups do, so the predicted peak of every plan
equals the peak the runtime reaches (fake tensors, live storages counted)."""

from __future__ import annotations

import pytest
import torch

from superneurons.errors import ConfigError
from superneurons.memory.bounds import working_sets
from superneurons.memory.planner import make_plan, min_peak_bytes
from superneurons.memory.profile import profile_step
from superneurons.memory.profile_types import layer_units
from superneurons.memory.simulate import simulate_plan
from superneurons.models.zoo import build_model, default_loss, model_input

KWARGS = {"layers": (1, 1, 1, 1), "width": 8, "num_classes": 10, "small_input": True}


def _setup():  # type: ignore[no-untyped-def]
    model = build_model("resnet", block="bottleneck", **KWARGS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = model_input("resnet", 4, image_size=16, **KWARGS)
    loss_fn = default_loss("resnet")
    profile = profile_step(model, x, y, loss_fn, opt, fake=True, units=layer_units(model))
    return model, opt, x, y, loss_fn, profile


def test_each_call_of_a_unit_has_its_own_window() -> None:
    *_, profile = _setup()
    relu = next(u for u in profile.units if u.fqn == "layer1.0.relu")
    assert len(relu.calls) == 3  # relu(bn1), relu(bn2), relu(out + identity)
    for (f0, e0, b0, _), (f1, e1, b1, _) in zip(relu.calls, relu.calls[1:], strict=False):
        assert f0 <= e0 < f1 <= e1  # forward calls in order, disjoint
        assert b1 < b0  # backward visits them in reverse
    assert (relu.fwd_start_event, relu.fwd_end_event) == (relu.calls[0][0], relu.calls[-1][1])
    # each storage the relu saved belongs to one call, and that call's window holds its birth
    for life in profile.storages:
        if relu.fqn in life.units:
            start, end, _, _ = relu.window(life.call_of(relu.fqn))
            assert life.birth <= end
    sets = working_sets(profile)
    assert sets[relu.fqn] > 0


@pytest.mark.parametrize("strategy", ["offload", "recompute", "checkpoint"])
def test_predicted_peak_equals_executed_with_repeated_calls(strategy: str) -> None:
    model, opt, x, y, loss_fn, profile = _setup()
    eager = profile.predicted_peak_bytes()
    floor = min_peak_bytes(profile)[strategy]
    checked = 0
    for budget in sorted({floor, (floor + eager) // 2}):
        try:
            plan = make_plan(profile, budget_bytes=budget, strategy=strategy)
        except ConfigError:
            continue
        executed = simulate_plan(model, x, y, loss_fn, opt, plan).measured_peak_bytes
        assert executed <= budget
        assert executed == pytest.approx(plan.predicted_peak_bytes, rel=0.03)
        checked += 1
    assert checked >= 1
