"""Device-memory timelines of one training step, eager and under a plan.

Both are measured the same way: a dispatch-level live-storage count
(:class:`~superneurons.memory.tracker.LiveStorageTracker`) of one steady-state step (optimizer
state already allocated), with the tensor pool's host buffers subtracted — host memory is not
device memory, also on a CPU where both are the same RAM.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from superneurons.memory.plan import ACTIONS, InfeasibleBudgetError, Plan
from superneurons.memory.planner import make_plan
from superneurons.memory.profile import profile_step
from superneurons.memory.runtime import apply_plan
from superneurons.memory.tracker import LiveStorageTracker

__all__ = ["MemoryComparison", "compare_memory"]

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class MemoryComparison:
    """One step's live device bytes per op, eager and under ``plan``."""

    eager_timeline_bytes: tuple[int, ...]
    planned_timeline_bytes: tuple[int, ...]
    eager_peak_bytes: int
    planned_peak_bytes: int
    budget_bytes: int
    plan: Plan

    def as_dict(self, *, max_points: int = 400) -> dict[str, Any]:
        return {
            "eager_peak_bytes": self.eager_peak_bytes,
            "planned_peak_bytes": self.planned_peak_bytes,
            "predicted_peak_bytes": self.plan.predicted_peak_bytes,
            "budget_bytes": self.budget_bytes,
            "host_bytes": self.plan.host_bytes,
            "strategy": self.plan.strategy,
            "actions": {a: self.plan.count(a) for a in ACTIONS},
            "eager_timeline_bytes": _downsample(self.eager_timeline_bytes, max_points),
            "planned_timeline_bytes": _downsample(self.planned_timeline_bytes, max_points),
        }


def _downsample(values: Sequence[int], max_points: int) -> list[int]:
    """Keep the shape and the peak: the max of each of ``max_points`` windows."""
    if len(values) <= max_points:
        return list(values)
    window = -(-len(values) // max_points)
    return [max(values[i : i + window]) for i in range(0, len(values), window)]


def _measure(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: Any,
    targets: Any,
    loss_fn: LossFn,
    host: Callable[[], Sequence[torch.Tensor]] = tuple,
) -> tuple[list[int], int]:
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        # the output lives through backward, as in train/loop.py and profile_step (default
        # keep_output=True): a step that drops it first has a lower eager peak than the profile
        # the plan is made from (an LM's logits, B*T*V*4 bytes)
        output = model(inputs)
        loss_fn(output, targets).backward()
        del output
        optimizer.step()

    step()  # steady state: optimizer state exists, DDP-free warm-up
    resident = [*model.parameters(), *model.buffers()]
    resident += [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    tracker = LiveStorageTracker(record_timeline=True)
    host_bytes = tracker.register(host())  # after the warm-up: the pool's slab has its size
    tracker.register(resident)
    with tracker:
        step()
    timeline = [b - host_bytes for b in tracker.timeline_bytes]
    return timeline, int(tracker.peak_bytes - host_bytes)


def compare_memory(
    model: nn.Module,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    inputs: Any,
    targets: Any,
    loss_fn: LossFn,
    *,
    budget_fraction: float,
    on_minimum: Callable[[float], None] | None = None,
) -> MemoryComparison:
    """Plan ``model`` under ``budget_fraction`` of eager's measured peak and measure one step
    eager and under the plan.

    Runs on copies: the caller's model is untouched. If the budget is below the planner's
    minimum, ``on_minimum`` (when given) is told that minimum as a fraction of eager's peak and
    the minimum is used; without it the planner's
    :class:`~superneurons.memory.plan.InfeasibleBudgetError` (it names the minimum) propagates.
    """
    eager_model = copy.deepcopy(model)
    eager, eager_peak = _measure(eager_model, make_optimizer(eager_model), inputs, targets, loss_fn)
    planned_model = copy.deepcopy(model)
    optimizer = make_optimizer(planned_model)
    profile = profile_step(planned_model, inputs, targets, loss_fn, optimizer)
    budget_bytes = int(eager_peak * budget_fraction)
    # The trainer runs the plan under DDP: no optimizer-in-backward (see train/loop.py); this
    # comparison steps the loop's own optimizer, so it stays on the device.
    try:
        plan = make_plan(
            profile,
            budget_bytes=budget_bytes,
            allow_optimizer_in_backward=False,
            allow_host_optimizer=False,
        )
    except InfeasibleBudgetError as exc:
        if on_minimum is None:
            raise
        on_minimum(exc.min_budget_bytes / eager_peak)
        budget_bytes = exc.min_budget_bytes
        plan = make_plan(
            profile,
            budget_bytes=budget_bytes,
            allow_optimizer_in_backward=False,
            allow_host_optimizer=False,
        )
    with apply_plan(planned_model, plan) as handle:
        planned, planned_peak = _measure(
            planned_model, optimizer, inputs, targets, loss_fn, host=handle.pool.host_buffers
        )
    return MemoryComparison(
        eager_timeline_bytes=tuple(eager),
        planned_timeline_bytes=tuple(planned),
        eager_peak_bytes=eager_peak,
        planned_peak_bytes=planned_peak,
        budget_bytes=budget_bytes,
        plan=plan,
    )
