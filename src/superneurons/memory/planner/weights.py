"""Which units' weights stream from the host, and what streaming them costs (pure).

A unit whose weights stream (``UnitDecision.weights == "host"``) keeps its parameters in the host
pool; the runtime (:mod:`superneurons.memory.offload.weights`) copies them to the device ahead of
the unit's forward and again ahead of its backward, one streamed unit ahead, and releases each
copy after use. This module predicts that, from the profile alone:

* **which bytes stream**: a parameter streams when every unit holding it streams and no module
  outside the units holds it (``Profile.unit_params``; tied embeddings stream with both units);
  a 4-bit weight's quantization state (absmax, codes, the nested state of double quantisation)
  streams with its weight; LLM.int8() weights never stream (their layer keeps the int8 values
  and scales in a state of its own);
* **where a copy is live** (:func:`weight_windows`): in forward from just before the previous
  streamed unit's first op (its prefetch) to the end of its own forward call; in backward from
  where backward enters the next streamed call in forward order (its prefetch; its own entry
  when none) to where backward enters the previous one (its release; the end of backward when
  none), at the same autograd-node edges the runtime hooks (``memory.nodes``); a unit whose
  backward reads none of its weights (an embedding: ``Profile.weightless_backward``) and is not
  recomputed has no backward copy;
* **the LM head in vocabulary slices** (:func:`sliced_head`; a head plan with ``vocab_rows``,
  :mod:`superneurons.memory.chunked.vocab`): a streamed head's weight is never on the device
  whole: the loss fetches one slice and the next inside the head's forward call and again
  inside its backward (two slices live), and each slice's gradient (one slice, in backward)
  goes to the host, so the weight's whole gradient is not on the device at all
  (:func:`host_gradients`); the slice's logits are in the profile's own head working set;
* **what it costs** (:func:`stream_cost`): each streamed byte crosses the host link twice per
  step; a fetch overlaps the unit's forward (forward) and twice that (backward): only the
  excess is exposed. :func:`stream_order` ranks units by exposed seconds per byte saved, so the
  planner streams first the units whose copies hide under compute.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from superneurons.memory.plan import RECOMPUTING
from superneurons.memory.planner.cost import CostModel
from superneurons.memory.profile_types import CATEGORIES, Profile, UnitParam

__all__ = [
    "WeightStreams",
    "host_gradients",
    "sliced_head",
    "stream_cost",
    "stream_order",
    "streamed_params",
    "weight_windows",
]


@dataclass(frozen=True)
class WeightStreams:
    """What streaming a set of units predicts.

    Attributes:
        host_bytes: pinned host bytes of the streamed parameters.
        streamed_bytes: bytes copied host -> device per step (forward and backward).
        transfer_s: their copy time at the cost model's host -> device rate.
        exposed_s: the part of it no compute hides.
    """

    host_bytes: int = 0
    streamed_bytes: int = 0
    transfer_s: float = 0.0
    exposed_s: float = 0.0


def streamed_params(profile: Profile, units: Collection[str]) -> dict[str, int]:
    """Streamed unit -> bytes of the parameters that stream with it (a shared parameter is
    counted with the first of its units in forward order)."""
    owned = dict.fromkeys((u.fqn for u in profile.units if u.fqn in units), 0)
    for param in profile.unit_params:
        if _streams(param, owned):
            owned[param.units[0]] += param.nbytes
    return owned


def _streams(param: UnitParam, units: Collection[str]) -> bool:
    """Whether ``param`` streams when ``units`` do: it can, and every unit holding it is one of
    them (a 4-bit weight's quantization state: every unit holding the weight)."""
    return param.streamable and bool(param.units) and all(u in units for u in param.units)


@dataclass(frozen=True)
class SlicedHead:
    """The LM head's weight streamed in vocabulary slices (module docstring)."""

    unit: str  # the unit holding the head
    param: UnitParam  # its weight
    slice_bytes: int  # bytes of one full slice
    slices: int  # how many


def sliced_head(profile: Profile, units: Collection[str]) -> SlicedHead | None:
    """The head's weight when the profile's head runs in vocabulary slices (``vocab_rows``) and
    it streams with ``units``, held by the head's unit alone (a tied one is not sliced)."""
    head = profile.head
    if head is None or not head.vocab_rows:
        return None
    unit = next((u for u in units if head.fqn == u or head.fqn.startswith(u + ".")), None)
    name = f"{head.fqn}.weight"
    param = next((p for p in profile.unit_params if p.fqn == name), None)
    if unit is None or param is None or param.units != (unit,) or param.rows < 1:
        return None
    if not _streams(param, units):
        return None
    rows = min(head.vocab_rows, param.rows)
    return SlicedHead(unit, param, param.nbytes // param.rows * rows, -(-param.rows // rows))


def host_gradients(profile: Profile, units: Collection[str]) -> frozenset[str]:
    """Parameters whose gradient is accumulated on the host when ``units`` stream: the
    trainable head weight in vocabulary slices."""
    sliced = sliced_head(profile, units)
    return frozenset([sliced.param.fqn] if sliced and sliced.param.trainable else [])


def _forward_only(
    profile: Profile, units: Collection[str], actions: Mapping[str, str] | None
) -> frozenset[str]:
    """The streamed units fetched for their forward only: their backward reads none of their
    weights (``Profile.weightless_backward``: an embedding) and they are not recomputed."""
    actions = actions or {}
    return frozenset(
        u
        for u in profile.weightless_backward
        if u in units and actions.get(u, "keep") not in RECOMPUTING
    )


def weight_windows(
    profile: Profile,
    units: Collection[str],
    table: np.ndarray,
    actions: Mapping[str, str] | None = None,
) -> None:
    """Move the streamed parameters' bytes in ``table``'s params row (in place): absent
    everywhere, live in the windows of the module docstring. A parameter held by two streamed
    units (tied embeddings) has one device copy, live while either window is open. The head's
    weight in vocabulary slices: two slices in the head's forward and backward, and one slice
    of its gradient in the grads row in backward."""
    params = CATEGORIES.index("params")
    table[params] -= sum(streamed_params(profile, units).values())
    held = set(streamed_params(profile, units))
    windows = _windows(profile, held, _forward_only(profile, held, actions))
    sliced = sliced_head(profile, held)
    if sliced is not None:
        _slice_windows(profile, sliced, table)
    # parameters grouped by the units holding them: a group's bytes are live on the union of
    # its units' windows (one copy however many windows are open), one pass over the events
    groups: dict[tuple[str, ...], int] = {}
    for param in profile.unit_params:
        if not _streams(param, held) or (sliced is not None and param is sliced.param):
            continue
        groups[param.units] = groups.get(param.units, 0) + param.nbytes
    by_unit: dict[str, list[tuple[int, int]]] = {}
    for start, end, unit in windows:
        start, end = max(start, 0), min(end, profile.num_events)
        if start < end:
            by_unit.setdefault(unit, []).append((start, end))
    delta = np.zeros(profile.num_events + 1, dtype=np.int64)
    for holders, nbytes in groups.items():
        spans = [span for unit in set(holders) for span in by_unit.get(unit, ())]
        for start, end in _union(spans):
            delta[start] += nbytes
            delta[end] -= nbytes
    table[params] += np.cumsum(delta[:-1])


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[start, end)`` spans merged where they overlap or touch, in order."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _slice_windows(profile: Profile, sliced: SlicedHead, table: np.ndarray) -> None:
    """The head's slices (the one computing and the next being fetched) inside each of its
    calls' forward and backward, and its gradient's slice inside the backward."""
    unit = next(u for u in profile.units if u.fqn == sliced.unit)
    live = min(2, sliced.slices) * sliced.slice_bytes
    for call in range(max(len(unit.calls), 1)):
        fwd_start, fwd_end, bwd_start, bwd_end = unit.window(call)
        spans = [(fwd_start, fwd_end)] + ([(bwd_start, bwd_end)] if bwd_start >= 0 else [])
        for start, end in spans:
            start, end = max(start, 0), min(end + 1, profile.num_events)
            table[CATEGORIES.index("params"), start:end] += live
        if bwd_start >= 0 and sliced.param.trainable:
            start, end = max(bwd_start, 0), min(bwd_end + 1, profile.num_events)
            table[CATEGORIES.index("grads"), start:end] += sliced.slice_bytes


def _windows(
    profile: Profile, held: Collection[str], forward_only: Collection[str] = ()
) -> list[tuple[int, int, str]]:
    """``(start, end, unit)``: each streamed call's forward and backward copy, live on events
    ``[start, end)``; the units of ``forward_only`` have no backward copy (entering their
    backward still closes the windows of later calls, as the runtime does)."""
    units = {u.fqn: u for u in profile.units}
    calls = sorted(
        ((u.fqn, c) for u in profile.units if u.fqn in held for c in range(max(len(u.calls), 1))),
        key=lambda k: units[k[0]].window(k[1])[0],
    )
    windows = []
    first_calls = [k for k in calls if k[1] == 0]
    for i, (fqn, _) in enumerate(first_calls):  # forward: prefetched one unit ahead
        ahead = units[first_calls[i - 1][0]].window(0)[0] - 1 if i > 0 else None
        for call in range(max(len(units[fqn].calls), 1)):
            fwd_start, fwd_end, _, _ = units[fqn].window(call)
            start = fwd_start - 1 if ahead is None else min(ahead, fwd_start - 1)
            windows.append((start, fwd_end + 1, fqn))
    entered = [k for k in calls if _entry(units[k[0]], k[1]) >= 0]
    for i, key in enumerate(entered):  # backward: the next call in forward order prefetches it
        own = _entry(units[key[0]], key[1])
        start = _entry(units[entered[i + 1][0]], entered[i + 1][1]) if i + 1 < len(entered) else own
        end = _entry(units[entered[i - 1][0]], entered[i - 1][1]) + 1 if i > 0 else None
        if key[0] in forward_only:
            continue
        windows.append(
            (min(start, own), profile.backward_end_event + 1 if end is None else end, key[0])
        )
    return windows


def _entry(unit: object, call: int) -> int:
    """Where backward entered the call's output nodes (-1: never: no gradient flows there)."""
    edges = getattr(unit, "edges", ())
    return int(edges[call][0]) if call < len(edges) else -1


def stream_cost(
    profile: Profile,
    units: Collection[str],
    cost: CostModel,
    actions: Mapping[str, str] | None = None,
) -> WeightStreams:
    """Host bytes, bytes streamed per step and their copy time, total and exposed (a unit
    fetched for its forward only: once per call)."""
    owned = streamed_params(profile, units)
    if not any(owned.values()):
        return WeightStreams()
    seconds = cost.unit_seconds(profile)
    by_fqn = {u.fqn: u for u in profile.units}
    forward_only = _forward_only(profile, owned, actions)
    transfer_s = exposed_s = 0.0
    streamed = 0
    for fqn, nbytes in _held(profile, owned).items():
        calls = max(len(by_fqn[fqn].calls), 1)
        fetch_s, compute_s = cost.fetch_s(nbytes), seconds[fqn] / calls
        copies = 1 if fqn in forward_only else 2
        streamed += copies * calls * nbytes
        transfer_s += copies * calls * fetch_s
        exposed_s += calls * max(0.0, fetch_s - compute_s)
        if copies == 2:
            exposed_s += calls * max(0.0, fetch_s - 2 * compute_s)
    return WeightStreams(sum(owned.values()), streamed, transfer_s, exposed_s)


def _held(profile: Profile, units: Collection[str]) -> dict[str, int]:
    """Streamed unit -> bytes of every streamed parameter it holds (a shared one in each: each
    of their windows fetches it)."""
    held = dict.fromkeys(units, 0)
    for param in profile.unit_params:
        if _streams(param, held):
            for unit in param.units:
                held[unit] += param.nbytes
    return held


def stream_order(profile: Profile, cost: CostModel) -> list[str]:
    """The units whose weights can stream, in ascending exposed seconds per byte they take
    off the device (copies hidden under compute first; a small tie-break by copy time, as host
    bandwidth is not free). A unit sharing a parameter with other units (tied embeddings)
    is ranked as if they streamed too: it frees those bytes once they all do. A unit holding a
    parameter that cannot stream (an LLM.int8() layer's) is left out: the runtime refuses it."""
    ranked = []
    seconds = cost.unit_seconds(profile)
    for unit in profile.units:
        held = [p for p in profile.unit_params if unit.fqn in p.units]
        nbytes = sum(p.nbytes for p in held if "" not in p.units)
        if nbytes == 0 or not all(p.streamable for p in held):
            continue
        calls = max(len(unit.calls), 1)
        fetch_s, compute_s = cost.fetch_s(nbytes), seconds[unit.fqn] / calls
        exposed_s = calls * (max(0.0, fetch_s - compute_s) + max(0.0, fetch_s - 2 * compute_s))
        ranked.append(((exposed_s + 2e-3 * calls * fetch_s) / nbytes, unit.fqn))
    return [fqn for _, fqn in sorted(ranked)]
