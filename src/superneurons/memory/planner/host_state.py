"""The planner's model of optimizer state in the host pool (pure): which state bytes stay on the
device, when the fetched ones are live, how many bytes cross the link each step.

:class:`~superneurons.memory.offload.optim_host.HostOptimizerState` executes what this predicts
(optimizer-in-backward with ``host_state``, :mod:`superneurons.memory.offload.optim_backward`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from superneurons.memory.planner.cost import MIN_STATE_OFFLOAD_BYTES

__all__ = ["HostStateModel", "host_state_timeline"]


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
