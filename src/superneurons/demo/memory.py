"""Device-memory timelines of one training step, eager and under a plan.

Both are measured the same way, in the view the plan's prediction describes, over one
steady-state step (optimizer state already allocated):

* **CPU**: the c10 allocator's bytes
  (:func:`~superneurons.bench.memory.meter.allocator_timeline_bytes`): live tensors plus the
  scratch kernels allocate for themselves (a convolution's backward) and the generator state a
  checkpoint stashes, which a real CPU profile counts. The tensor pool's host slab is allocated
  in the warm-up, before the measured step, and is not in it.
* **CUDA**: a dispatch-level live-storage count
  (:class:`~superneurons.memory.tracker.LiveStorageTracker`) with the pool's pinned host
  buffers subtracted (a CUDA profile counts no kernel workspaces: ``memory.profiling.workspace``).

The live-storage peak is recorded beside it on both (``*_tracked_peak_bytes``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from superneurons.bench.memory.meter import allocator_timeline_bytes
from superneurons.memory.plan import ACTIONS, InfeasibleBudgetError, Plan
from superneurons.memory.planner.decide import make_plan
from superneurons.memory.profiling.step import profile_step
from superneurons.memory.runtime.apply import apply_plan
from superneurons.memory.tracker import LiveStorageTracker

__all__ = ["MemoryComparison", "compare_memory"]

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class MemoryComparison:
    """One step's device bytes, eager and under ``plan``, in the view ``measured_by`` names
    (the c10 allocator's after each allocation and free on CPU, live storages per op on CUDA)."""

    eager_timeline_bytes: tuple[int, ...]
    planned_timeline_bytes: tuple[int, ...]
    eager_peak_bytes: int
    planned_peak_bytes: int
    budget_bytes: int
    plan: Plan
    # the live-storage view of the same steps (equal to the peaks above on CUDA)
    eager_tracked_peak_bytes: int = 0
    planned_tracked_peak_bytes: int = 0
    measured_by: str = "live storages"

    def as_dict(self, *, max_points: int = 400) -> dict[str, Any]:
        return {
            "eager_peak_bytes": self.eager_peak_bytes,
            "planned_peak_bytes": self.planned_peak_bytes,
            "eager_tracked_peak_bytes": self.eager_tracked_peak_bytes,
            "planned_tracked_peak_bytes": self.planned_tracked_peak_bytes,
            "measured_by": self.measured_by,
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


@dataclass(frozen=True)
class _Measured:
    timeline_bytes: list[int]
    peak_bytes: int
    tracked_peak_bytes: int
    measured_by: str


def _measure(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: Any,
    targets: Any,
    loss_fn: LossFn,
    host: Callable[[], Sequence[torch.Tensor]] = tuple,
) -> _Measured:
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

    def resident() -> list[torch.Tensor]:
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        leaves = [t for t in tree_flatten((inputs, targets))[0] if isinstance(t, torch.Tensor)]
        return [*model.parameters(), *model.buffers(), *state, *leaves]

    tracker = LiveStorageTracker(record_timeline=True)
    host_bytes = tracker.register(host())  # after the warm-up: the pool's slab has its size
    tracker.register(resident())
    with tracker:
        step()
    tracked = [b - host_bytes for b in tracker.timeline_bytes]
    tracked_peak = int(tracker.peak_bytes - host_bytes)
    first = next(iter(model.parameters()), None)
    if first is None or first.device.type != "cpu":
        return _Measured(tracked, tracked_peak, tracked_peak, "live storages")
    # NOTE: a real CPU profile counts each op's scratch (profile_step), so the plan predicts the
    # allocator's view; the live-storage count misses a convolution backward's scratch (6 MiB
    # of the demo ResNet's 36 MiB plan at batch 64)
    timeline = allocator_timeline_bytes(step, resident=resident)
    return _Measured(timeline, max(timeline), tracked_peak, "c10 cpu allocator")


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
    eager = _measure(eager_model, make_optimizer(eager_model), inputs, targets, loss_fn)
    planned_model = copy.deepcopy(model)
    optimizer = make_optimizer(planned_model)
    profile = profile_step(planned_model, inputs, targets, loss_fn, optimizer)
    budget_bytes = int(eager.peak_bytes * budget_fraction)
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
        on_minimum(exc.min_budget_bytes / eager.peak_bytes)
        budget_bytes = exc.min_budget_bytes
        plan = make_plan(
            profile,
            budget_bytes=budget_bytes,
            allow_optimizer_in_backward=False,
            allow_host_optimizer=False,
        )
    with apply_plan(planned_model, plan) as handle:
        planned = _measure(
            planned_model, optimizer, inputs, targets, loss_fn, host=handle.pool.host_buffers
        )
    return MemoryComparison(
        eager_timeline_bytes=tuple(eager.timeline_bytes),
        planned_timeline_bytes=tuple(planned.timeline_bytes),
        eager_peak_bytes=eager.peak_bytes,
        planned_peak_bytes=planned.peak_bytes,
        budget_bytes=budget_bytes,
        plan=plan,
        eager_tracked_peak_bytes=eager.tracked_peak_bytes,
        planned_tracked_peak_bytes=planned.tracked_peak_bytes,
        measured_by=planned.measured_by,
    )
