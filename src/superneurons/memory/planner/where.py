"""Where an event of a profiled step is: the unit and the phase (``plan --json`` ``peak_at``)."""

from __future__ import annotations

from typing import Any

from superneurons.memory.profile_types import Profile

__all__ = ["locate"]


def locate(profile: Profile, event: int) -> dict[str, Any]:
    """Where event ``event`` of the step is: ``{"unit", "phase", "event"}`` (``plan --json``
    ``peak_at``).

    Phases: ``forward`` (inside a unit call, or "" between units), ``loss`` (after the last
    unit's forward up to the loss, and backward before it enters a unit: unit ``"<loss>"``),
    ``backward`` (the unit backward entered last), ``step`` (the optimizer: ``"<optimizer>"``).
    """
    where: dict[str, Any] = {"unit": "", "phase": "forward", "event": int(event)}
    if event < 0:
        return where
    calls = [(u.fqn, u.window(c), c, u) for u in profile.units for c in range(max(len(u.calls), 1))]
    if event > profile.backward_end_event:
        return {**where, "unit": "<optimizer>", "phase": "step"}
    if event <= profile.forward_end_event:
        last_end = max((w[1] for _, w, _, _ in calls), default=-1)
        if event > last_end:
            return {**where, "unit": "<loss>", "phase": "loss"}
        inside = [(w[1] - w[0], f) for f, w, _, _ in calls if w[0] <= event <= w[1]]
        return {**where, "unit": min(inside)[1] if inside else ""}
    entered = []
    for fqn, window, call, unit in calls:
        edge = unit.edges[call][0] if call < len(unit.edges) else -1
        start = min(e for e in (edge, window[2]) if e >= 0) if max(edge, window[2]) >= 0 else -1
        if 0 <= start <= event:
            entered.append((start, fqn))
    if not entered:
        return {**where, "unit": "<loss>", "phase": "loss"}
    return {**where, "unit": max(entered)[1], "phase": "backward"}
