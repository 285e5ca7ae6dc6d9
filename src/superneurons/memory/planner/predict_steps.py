"""Where the optimizer steps, in a predicted timeline: inside backward (its state on the device
or in the host pool), or on the host.

:func:`~superneurons.memory.planner.predict.evaluate` starts from the profile's steady-state
timeline (the step after backward, on the device); a plan that steps the optimizer elsewhere changes
the gradient, optimizer and step-phase rows as these functions do, in place (``table``: the
``CATEGORIES`` rows; ``head``: the LM head + loss part of the saved and temporaries rows).
:func:`host_state_timeline` is the model of optimizer state in the host pool, which
:class:`~superneurons.memory.offload.optim_host.HostOptimizerState` executes.

A :class:`~superneurons.memory.plan.TrainingStep` that clips or accumulates changes them: with
accumulation the gradients of the earlier micro-batches stay (:func:`accumulated_gradients`:
on the device, or in host buffers for the host optimizer, whose last micro-batch brings each
bucket's sum back to add it before the all-reduce); with either, the optimizer cannot step a
parameter as its gradient arrives, so optimizer-in-backward keeps every gradient to the end of
backward and steps there, and the host optimizer's step no longer hides behind backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from superneurons.memory.plan import TrainingStep
from superneurons.memory.planner.buckets import assign_buckets, bucket_timeline
from superneurons.memory.planner.cost import MIN_STATE_OFFLOAD_BYTES, CostModel
from superneurons.memory.profile_types import CATEGORIES, Profile

__all__ = [
    "HostStateModel",
    "accumulated_gradients",
    "host_optimizer_cost",
    "host_state_timeline",
    "step_in_backward",
    "step_on_host",
]

_PLAIN = TrainingStep()

# NOTE: a foreach optimizer's step holds temporaries of all its parameters at once; in
# backward each parameter has its own optimizer, so no more than a single-tensor step's
# (AdamW: 2 parameter-sized) is ever held per parameter: the measured ratio is capped
_MAX_STEP_TEMP = 2.0


def _after_backward(table: np.ndarray, head: np.ndarray, profile: Profile) -> None:
    """The step phase holds the parameters (and the output a loop carries) only."""
    be = profile.backward_end_event
    params = int(table[CATEGORIES.index("params"), 0])
    table[:, be + 1 :] = 0
    head[:, be + 1 :] = 0
    table[CATEGORIES.index("params"), be + 1 :] = params
    # a loop that carries the output holds it through the (empty) step phase too
    table[CATEGORIES.index("temporaries"), be + 1 :] = profile.carried_output_bytes
    head[1, be + 1 :] = profile.carried_head_bytes


def step_in_backward(
    table: np.ndarray, head: np.ndarray, profile: Profile, step: TrainingStep = _PLAIN
) -> None:
    """Each gradient's post-accumulate hook steps its parameter (in place, as SGD/Adam do per
    parameter) and frees the gradient at once; the state stays where it was. A ``step`` that
    clips or accumulates: :func:`_step_after_backward` instead."""
    be = profile.backward_end_event
    # the step's own transient (single-tensor AdamW: two parameter-sized temporaries, a
    # fused kernel none), measured in the profile's step, now happens in each gradient's
    # hook during backward: per byte of parameter, as the largest parameter's step shows
    per_byte = _step_temporaries_per_byte(table, profile)
    if step.waits:
        _step_after_backward(table, head, profile, per_byte)
        return
    state = int(table[CATEGORIES.index("optimizer"), 0])
    table[CATEGORIES.index("grads")] = 0
    _after_backward(table, head, profile)
    table[CATEGORIES.index("optimizer"), be + 1 :] = state
    # a gradient made before it is accumulated (a chunked head's forward) lives from its birth
    # to its hook
    last = profile.num_events - 1
    for birth, ready, nbytes in profile.gradients:
        table[CATEGORIES.index("grads"), min(birth, last) : min(ready, last) + 1] += nbytes
        table[CATEGORIES.index("temporaries"), min(ready, last)] += int(per_byte * nbytes)


def _step_temporaries_per_byte(table: np.ndarray, profile: Profile) -> float:
    step_rows = table[CATEGORIES.index("temporaries"), profile.backward_end_event + 1 :]
    return min(
        float(step_rows.max(initial=0)) / max(profile.largest_param_bytes, 1), _MAX_STEP_TEMP
    )


def _step_after_backward(
    table: np.ndarray, head: np.ndarray, profile: Profile, per_byte: float
) -> None:
    """Optimizer-in-backward under clipping or accumulation: the hooks step nothing; when the
    last micro-batch's backward ends the gradients are clipped by their global norm and each
    parameter steps alone, its gradient freed after its step. So every gradient lives to the
    end of backward (the rows as they are) and the step phase holds one parameter's step
    transient instead of the whole optimizer's."""
    be = profile.backward_end_event
    state = int(table[CATEGORIES.index("optimizer"), 0])
    grads = table[CATEGORIES.index("grads"), be + 1 :].copy()
    _after_backward(table, head, profile)
    table[CATEGORIES.index("grads"), be + 1 :] = grads
    table[CATEGORIES.index("optimizer"), be + 1 :] = state
    table[CATEGORIES.index("temporaries"), be + 1 :] += int(per_byte * profile.largest_param_bytes)


def accumulated_gradients(table: np.ndarray, profile: Profile) -> None:
    """Gradients accumulated on the device over micro-batches: after the first micro-batch
    every gradient is resident for the whole step, and each new one is a transient from its
    birth until autograd adds it into ``.grad`` (in place) at its hook. The first micro-batch
    is the plain step, which this bounds from above."""
    row = CATEGORIES.index("grads")
    last = profile.num_events - 1
    table[row] = profile.grad_bytes
    for birth, ready, nbytes in profile.gradients:
        table[row, min(birth, last) : min(ready, last) + 1] += nbytes


def step_on_host(
    table: np.ndarray,
    head: np.ndarray,
    profile: Profile,
    buckets: tuple[tuple[str, ...], ...] | None,
    step: TrainingStep = _PLAIN,
    host_grads: frozenset[str] = frozenset(),
) -> None:
    """The optimizer on the host: no state on the device, gradients live as ``buckets``
    (default :func:`~superneurons.memory.planner.buckets.assign_buckets`) are launched and
    drained; with accumulation the last micro-batch also brings each bucket's accumulated sum
    back for the moment it is added (:func:`~superneurons.memory.planner.buckets.
    bucket_timeline` ``staged``). The gradients of ``host_grads`` (parameter fqns) are
    accumulated on the host: no device byte (``memory.planner.weights.host_gradients``)."""
    _after_backward(table, head, profile)
    table[CATEGORIES.index("optimizer")] = 0
    gradients = profile.gradients
    if host_grads:
        names = profile.grad_params
        gradients = tuple(
            (b, r, 0 if i < len(names) and names[i] in host_grads else n)
            for i, (b, r, n) in enumerate(gradients)
        )
    if buckets is None:
        buckets = assign_buckets(gradients, profile.grad_params)
    table[CATEGORIES.index("grads")] = bucket_timeline(
        gradients,
        profile.grad_params,
        buckets,
        num_events=profile.num_events,
        backward_end=profile.backward_end_event,
        staged=step.accumulation_steps > 1,
    )


def host_optimizer_cost(
    profile: Profile, cost: CostModel, step: TrainingStep = _PLAIN
) -> tuple[float, float, int]:
    """(copy seconds, exposed seconds, host bytes) of the host optimizer, per micro-batch.

    Gradients go out and parameters come back beside backward, and the host steps each bucket
    beside it too, so only the excess over backward is exposed; the host holds fp32 masters
    and fp32 state. A ``step`` that clips or accumulates: the host step waits for the end of
    the last micro-batch's backward, so all of it is exposed with the copies back (each
    bucket's is issued after its step; on CUDA it runs beside the next bucket's step, so this
    bounds it), once per ``accumulation_steps`` micro-batches, and the host also holds a copy
    of every gradient (their sums); with
    accumulation the last micro-batch brings those sums back to the device beside its
    backward."""
    backward_s = 2 * sum(cost.compute_s(u, fake=profile.fake) for u in profile.units)
    # frozen parameters (adapters' base weights) are neither stepped nor copied back
    trained_bytes = profile.param_bytes - profile.frozen_bytes
    out_s, in_s = cost.copy_s(profile.grad_bytes), cost.fetch_s(trained_bytes)
    step_s = profile.param_numel * cost.host_step_s_per_param
    itemsize = trained_bytes / max(profile.param_numel, 1)
    host_bytes = 4 * profile.param_numel + int(profile.optimizer_state_bytes * 4 / max(itemsize, 1))
    if not step.waits:
        exposed_s = sum(max(0.0, t - backward_s) for t in (out_s, step_s, in_s))
        return out_s + in_s, exposed_s, host_bytes
    k = step.accumulation_steps
    sums_in_s = cost.fetch_s(profile.grad_bytes) if k > 1 else 0.0
    copy_s = out_s + (sums_in_s + in_s) / k
    exposed_s = max(0.0, out_s - backward_s) + max(0.0, sums_in_s - backward_s) / k
    exposed_s += (step_s + in_s) / k
    return copy_s, exposed_s, host_bytes + profile.grad_bytes


@dataclass(frozen=True)
class HostStateModel:
    """The predicted device side of host-pool optimizer state for one step.

    Attributes:
        device_row: per event, optimizer-state bytes on the device (the small state that stays,
            plus the fetched state of the parameter being stepped or prefetched).
        host_bytes: state bytes in the host slab.
        copied_bytes: bytes copied each way per step (each host-held state goes and comes back).
        resident_bytes: state bytes that stay on the device (small tensors, step counters).
    """

    device_row: np.ndarray
    host_bytes: int
    copied_bytes: int
    resident_bytes: int


def host_state_timeline(
    grad_births: tuple[tuple[int, int], ...],
    optimizer_state_bytes: int,
    num_events: int,
    *,
    min_offload_bytes: int = MIN_STATE_OFFLOAD_BYTES,
    after_event: int | None = None,
) -> HostStateModel:
    """Model what :class:`HostOptimizerState` keeps on the device, event by event.

    Each parameter's state is ``k`` parameter-sized tensors, ``k = round(state / grads)``
    (1 for SGD momentum, 2 for Adam/AdamW); what is left (Adam's step counters) and the state
    of parameters below ``min_offload_bytes`` stays resident. The state of the parameters whose
    gradients are born at event ``e`` is on the device one parameter at a time while their hooks
    step them (the largest counts at ``e``); the first of them was prefetched right after the
    hooks of the previous such event, so it is also live in between (the runtime's one-ahead
    prefetch). The first parameter of backward is fetched on demand. ``after_event`` (the end of
    backward, where clipping or accumulation makes the steps wait): every parameter steps after
    it, one at a time, so the largest state is on the device from then on.
    """
    grad_total = sum(nbytes for _, nbytes in grad_births)
    per_param = round(optimizer_state_bytes / grad_total) if grad_total else 0
    by_event: dict[int, list[int]] = {}
    for birth, nbytes in grad_births:
        if nbytes >= max(min_offload_bytes, 1) and per_param:
            event = min(max(birth, 0), num_events - 1)
            by_event.setdefault(event, []).append(per_param * nbytes)
    host_bytes = sum(sum(states) for states in by_event.values())
    resident = max(optimizer_state_bytes - host_bytes, 0)
    row = np.full(num_events, resident, dtype=np.int64)
    if after_event is not None:
        row[min(after_event + 1, num_events - 1) :] += max(
            (max(states) for states in by_event.values()), default=0
        )
        return HostStateModel(row, host_bytes, host_bytes, resident)
    previous = -1
    for event in sorted(by_event):
        states = by_event[event]
        row[event] += max(states)
        if previous >= 0 and previous + 1 < event:
            # prefetched after the previous event's hooks: the first state stepped here (the
            # hooks' order is not known here: the largest is the safe bound)
            row[previous + 1 : event] += max(states)
        previous = event
    return HostStateModel(row, host_bytes, host_bytes, resident)
