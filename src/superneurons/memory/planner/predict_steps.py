"""Where the optimizer steps, in a predicted timeline: inside backward (its state on the device
or in the host pool), or on the host.

:func:`~superneurons.memory.planner.predict.evaluate` starts from the profile's steady-state
timeline (the step after backward, on the device); a plan that steps the optimizer elsewhere changes
the gradient, optimizer and step-phase rows as these functions do, in place (``table``: the
``CATEGORIES`` rows; ``head``: the LM head + loss part of the saved and temporaries rows).
:func:`host_state_timeline` is the model of optimizer state in the host pool, which
:class:`~superneurons.memory.offload.optim_host.HostOptimizerState` executes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from superneurons.memory.planner.buckets import assign_buckets, bucket_timeline
from superneurons.memory.planner.cost import MIN_STATE_OFFLOAD_BYTES, CostModel
from superneurons.memory.profile_types import CATEGORIES, Profile

__all__ = [
    "HostStateModel",
    "host_optimizer_cost",
    "host_state_timeline",
    "step_in_backward",
    "step_on_host",
]

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


def step_in_backward(table: np.ndarray, head: np.ndarray, profile: Profile) -> None:
    """Each gradient's post-accumulate hook steps its parameter (in place, as SGD/Adam do per
    parameter) and frees the gradient at once; the state stays where it was."""
    be = profile.backward_end_event
    # the step's own transient (single-tensor AdamW: two parameter-sized temporaries, a
    # fused kernel none), measured in the profile's step, now happens in each gradient's
    # hook during backward: per byte of parameter, as the largest parameter's step shows
    step_rows = table[CATEGORIES.index("temporaries"), be + 1 :]
    per_byte = min(
        float(step_rows.max(initial=0)) / max(profile.largest_param_bytes, 1), _MAX_STEP_TEMP
    )
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


def step_on_host(
    table: np.ndarray,
    head: np.ndarray,
    profile: Profile,
    buckets: tuple[tuple[str, ...], ...] | None,
) -> None:
    """The optimizer on the host: no state on the device, gradients live as ``buckets``
    (default :func:`~superneurons.memory.planner.buckets.assign_buckets`) are launched and
    drained."""
    _after_backward(table, head, profile)
    table[CATEGORIES.index("optimizer")] = 0
    gradients = profile.gradients
    if buckets is None:
        buckets = assign_buckets(gradients, profile.grad_params)
    table[CATEGORIES.index("grads")] = bucket_timeline(
        gradients,
        profile.grad_params,
        buckets,
        num_events=profile.num_events,
        backward_end=profile.backward_end_event,
    )


def host_optimizer_cost(profile: Profile, cost: CostModel) -> tuple[float, float, int]:
    """(copy seconds, exposed seconds, host bytes) of the host optimizer: gradients go out and
    parameters come back beside backward, and the host steps each bucket beside it too, so
    only the excess over backward is exposed; the host holds fp32 masters and fp32 state."""
    backward_s = 2 * sum(cost.compute_s(u, fake=profile.fake) for u in profile.units)
    # frozen parameters (adapters' base weights) are neither stepped nor copied back
    trained_bytes = profile.param_bytes - profile.frozen_bytes
    out_s, in_s = cost.copy_s(profile.grad_bytes), cost.fetch_s(trained_bytes)
    step_s = profile.param_numel * cost.host_step_s_per_param
    exposed_s = sum(max(0.0, t - backward_s) for t in (out_s, step_s, in_s))
    itemsize = trained_bytes / max(profile.param_numel, 1)
    host_bytes = 4 * profile.param_numel + int(profile.optimizer_state_bytes * 4 / max(itemsize, 1))
    return out_s + in_s, exposed_s, host_bytes


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
) -> HostStateModel:
    """Model what :class:`HostOptimizerState` keeps on the device, event by event.

    Each parameter's state is ``k`` parameter-sized tensors, ``k = round(state / grads)``
    (1 for SGD momentum, 2 for Adam/AdamW); what is left (Adam's step counters) and the state
    of parameters below ``min_offload_bytes`` stays resident. The state of the parameters whose
    gradients are born at event ``e`` is on the device one parameter at a time while their hooks
    step them (the largest counts at ``e``); the first of them was prefetched right after the
    hooks of the previous such event, so it is also live in between (the runtime's one-ahead
    prefetch). The first parameter of backward is fetched on demand.
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
