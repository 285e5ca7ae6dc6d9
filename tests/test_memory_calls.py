"""A module called several times in one forward (a bottleneck's one ``ReLU``, three calls) is
modelled call by call: each call's saved tensors leave at the end of that call and come back
in that call's backward, as the runtime's pool groups do, so the predicted peak of every plan
equals the peak the runtime reaches (fake tensors, live storages counted). Also: a storage the
step's first op makes is the step's own, not the caller's."""

from __future__ import annotations

import pytest
import torch

from superneurons.errors import ConfigError
from superneurons.memory.planner.bounds import working_sets
from superneurons.memory.planner.decide import make_plan, min_peak_bytes
from superneurons.memory.profile_types import layer_units
from superneurons.memory.profiling.step import profile_step
from superneurons.memory.sizing.simulate import simulate_plan
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


def test_the_first_ops_output_is_not_taken_for_an_input() -> None:
    """The stem conv's output is born at event 0, as are (clamped) the storages alive before
    the step: only the latter are the caller's. Offloading the BatchNorm that saves the conv's
    output frees it, predicted and measured alike (real CPU tensors)."""
    from superneurons.bench.memory.meter import device_peak_bytes
    from superneurons.memory.offload.pool import PoolConfig
    from superneurons.memory.plan import Plan, UnitDecision
    from superneurons.memory.planner.predict import evaluate
    from superneurons.memory.runtime.apply import apply_plan

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(16),
        torch.nn.Tanh(),
        torch.nn.Conv2d(16, 16, 3, padding=1),
    )
    x = torch.randn(8, 3, 32, 32)

    def loss_fn(out: torch.Tensor, _y: object) -> torch.Tensor:
        return out.square().mean()

    profile = profile_step(model, x, None, loss_fn)
    born_first = [s for s in profile.storages if s.birth == 0 and "1" in s.units]
    assert born_first and not any(s.from_caller for s in born_first)  # the conv's output
    assert any(s.from_caller for s in profile.storages if "0" in s.units)  # x itself
    actions = {u.fqn: "offload" if u.fqn == "1" else "keep" for u in profile.units}
    plan = Plan(
        units=tuple(UnitDecision(f, a) for f, a in actions.items()),
        strategy="offload",
        budget_bytes=1 << 40,
    )
    predicted = evaluate(profile, actions).peak_bytes
    assert predicted < profile.predicted_peak_bytes()  # offloading it frees something

    def step() -> None:
        loss_fn(model(x), None).backward()

    with apply_plan(model, plan, pool_config=PoolConfig(host_bytes=1 << 20)) as handle:
        step()  # warm-up: the slab has its size
        model.zero_grad(set_to_none=True)
        resident = [*model.parameters(), *model.buffers(), x]
        measured = device_peak_bytes(step, resident=resident, host=handle.pool.host_buffers())
    assert measured == pytest.approx(predicted, rel=0.03)
