"""Predict a plan's device peak and cost from a Profile (pure; no tensors are touched).

Given per-unit actions (keep / offload / recompute / recompute+offload), :func:`evaluate`
replays the profile's measured live intervals, call by call (a module called several times in
one forward has one window per call): a storage saved only by non-keep units is absent
between the end of its units' forward call and their backward (recompute) or the prefetch one unit
ahead (offload, and the checkpoint of recompute+offload); a plain checkpoint's input stays;
recompute adds its transient forward bytes at the unit's backward start.
``optimizer_in_backward`` frees each gradient as soon as it is applied, so the gradient row of
the timeline and the step phase drop to the largest single gradient. :class:`CostModel` turns
FLOPs, bytes and copies into seconds; :func:`segment_runs` groups consecutive recompute units
into memory-centric segments (SuperNeurons, Wang et al., PPoPP'18 §3.3). ``host_optimizer``
keeps no optimizer state on the device and each gradient only until its bucket is drained
(:func:`superneurons.memory.planner.buckets.bucket_timeline`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from superneurons.memory.plan import OFFLOADING, RECOMPUTING
from superneurons.memory.planner.cost import MIN_OFFLOAD_BYTES, CostModel
from superneurons.memory.planner.host_state import host_state_timeline
from superneurons.memory.planner.predict_steps import (
    host_optimizer_cost,
    step_in_backward,
    step_on_host,
)
from superneurons.memory.planner.where import locate
from superneurons.memory.profile_types import CATEGORIES, Profile, StorageLife

__all__ = ["BREAKDOWN", "CostModel", "Outcome", "evaluate", "segment_runs"]

# What the live bytes at a plan's peak are (docs/CONTRACTS.md, ``plan --json``): they sum to
# the predicted peak exactly.
BREAKDOWN: tuple[str, ...] = (
    "params",
    "grads",
    "optimizer",
    "activations",  # saved tensors of the units (and checkpoint inputs a plan keeps)
    "head_loss",  # saved tensors and temporaries of the LM head unit and of the loss
    "temporaries",  # everything else transient (recompute transients included)
)


@dataclass(frozen=True)
class Outcome:
    """What :func:`evaluate` predicts for one set of actions.

    ``breakdown`` (keys :data:`BREAKDOWN`) is the live bytes at the peak by what they are and
    sums to ``peak_bytes``; ``peak_at`` is where the peak is
    (:func:`~superneurons.memory.planner.where.locate`).
    """

    peak_bytes: int
    host_bytes: int
    extra_compute_s: float
    transfer_s: float
    exposed_s: float
    peak_event: int = -1
    optimizer_host_bytes: int = 0  # optimizer state in the host pool (optimizer_on_host)
    optimizer_copy_s: float = 0.0  # its copy time per step, both directions
    breakdown: dict[str, int] = field(default_factory=dict)
    peak_at: dict[str, Any] = field(default_factory=dict)


def evaluate(
    profile: Profile,
    actions: dict[str, str],
    *,
    optimizer_in_backward: bool = False,
    cost: CostModel | None = None,
    segments: dict[str, int] | None = None,
    min_offload_bytes: int = MIN_OFFLOAD_BYTES,
    optimizer_on_host: bool = False,
    host_optimizer: bool = False,
    buckets: tuple[tuple[str, ...], ...] | None = None,
) -> Outcome:
    """Predict peak bytes, host bytes and time overheads of per-unit ``actions`` (fqn -> action).

    ``segments`` (fqn -> segment id) groups consecutive recompute units under one outer
    checkpoint: only the first unit's input stays saved; the inner units' inputs come back when
    the segment is recomputed at the backward start of its last unit. Storages smaller than
    ``min_offload_bytes`` stay on the device, as the pool keeps them
    (:attr:`~superneurons.memory.offload.pool.PoolConfig.min_offload_bytes`).
    ``optimizer_on_host`` (with ``optimizer_in_backward``): the optimizer state lives in the
    host pool; on the device only what :func:`~superneurons.memory.offload.optim_backward.
    host_state_timeline` keeps there.
    ``host_optimizer``: the optimizer runs on the host; gradients live on the device as
    ``buckets`` (default: :func:`~superneurons.memory.planner.buckets.assign_buckets`) are launched and
    drained; after backward only the parameters remain.
    """
    cost = cost or CostModel()
    segments = segments or {}
    table = profile.timeline_array(steady_state=True)
    head = profile.head_rows()  # (saved, temporaries) of the LM head + loss, inside table
    if optimizer_in_backward:
        step_in_backward(table, head, profile)
    if host_optimizer:
        step_on_host(table, head, profile, buckets)
    host_state = None
    if optimizer_in_backward and optimizer_on_host:
        # NOTE: timed by the gradients' births, not their hooks: measured here, the fetched state
        # of the first large parameter of backward is live from its gradient's birth (the
        # executed peak equals this model's on the zoo GPT's plans, test_memory_optim_host)
        host_state = host_state_timeline(
            profile.grad_births, profile.optimizer_state_bytes, profile.num_events
        )
        table[CATEGORIES.index("optimizer")] = host_state.device_row
    total = table.sum(axis=0)
    change = np.zeros(profile.num_events + 1, dtype=np.int64)
    head_change = np.zeros(profile.num_events + 1, dtype=np.int64)  # the head + loss part
    units = {u.fqn: u for u in profile.units}
    # one window per forward call of each unit, in forward order (a module called several
    # times saves, releases and gets back each call's tensors separately: one pool group each)
    calls = {(u.fqn, c): u.window(c) for u in profile.units for c in range(max(len(u.calls), 1))}
    order = sorted(calls, key=lambda k: calls[k][0])
    next_call = {a: b for a, b in zip(order, order[1:], strict=False)}
    members: dict[int, list[str]] = {}
    for fqn in (u.fqn for u in profile.units):
        if fqn in segments:
            members.setdefault(segments[fqn], []).append(fqn)

    def edge(key: tuple[str, int], side: int) -> int:
        # where backward entered (side 0) or left (1) a unit call's output nodes, measured by
        # the profile (memory.nodes); never entered: its first unpack; never left: -1
        unit, call = units[key[0]], key[1]
        measured = unit.edges[call][side] if call < len(unit.edges) else -1
        return measured if measured >= 0 or side else calls[key][2]

    def prefetched(fqn: str, call: int = 0) -> int:
        # the runtime prefetches a call's pool group where backward enters the next unit call
        # in forward order if that one is offloaded too (for a recompute+offload one: where
        # backward leaves its output nodes, after the recompute they triggered), else where
        # backward enters the call itself
        bwd = edge((fqn, call), 0)
        nxt = next_call.get((fqn, call))
        if nxt is not None and actions.get(nxt[0], "") in OFFLOADING:
            ahead = edge(nxt, 1 if actions[nxt[0]] == "recompute+offload" else 0)
            bwd = ahead if 0 <= ahead < bwd else bwd
        return bwd

    host_bytes = 0
    internal: dict[str, int] = {}  # saved bytes born inside each unit (its recompute re-creates)
    inputs: dict[str, int] = {}  # saved bytes born before the unit (its checkpoint)
    for life in profile.storages:
        for f in life.units:
            if f and life.birth >= units[f].window(life.call_of(f))[0]:
                internal[f] = internal.get(f, 0) + life.nbytes
            elif f:
                inputs[f] = inputs.get(f, 0) + life.nbytes
    for life in profile.storages:
        packers = life.units
        if "" in packers or any(actions.get(f, "keep") == "keep" for f in packers):
            continue
        if life.from_caller or life.death >= profile.num_events - 1:
            continue  # the caller holds it (an input, an output): moving it frees nothing
        # where it lives again after its release: (start, end) event windows. A prefetched
        # checkpoint lives until its unit's backward is over; what a recompute re-creates is
        # a new storage that lives until the eager death, as does what a prefetch brings back.
        releases, windows, held, copies = [], [], False, 0
        death = life.death + 1
        # the pool keeps it where it is: too small to be worth a copy, or saved as a broadcast
        small = life.nbytes < min_offload_bytes or life.pool_keeps
        for f in packers:
            action, call = actions[f], life.call_of(f)
            fwd_start, fwd_end, bwd_start, bwd_end = units[f].window(call)
            if action in RECOMPUTING and life.birth < fwd_start:
                group = members.get(segments.get(f, -1), [f])
                if group[0] != f:  # an inner input of a segment: the segment recomputes it
                    releases.append(units[group[-1]].fwd_end_event)
                    windows.append((units[group[-1]].bwd_start_event + 1, death))
                    continue
                if action == "recompute" or small:
                    held = True  # a checkpoint's input stays saved
                    break
                releases.append(fwd_end)  # the checkpoint goes to the host pool
                windows.append((prefetched(f, call) + 1, max(bwd_end, bwd_start) + 2))
                copies += 1
                continue
            if action == "offload" and small:
                held = True
                break
            releases.append(fwd_end)
            if action == "offload":
                windows.append((prefetched(f, call) + 1, death))
                copies += 1  # the pool copies it once, whichever units saved it
            else:
                windows.append((bwd_start + 1, death))  # recomputed
        if held:
            continue
        # NOTE: an unpack at event e happens after op e, when the storages that died at e are
        # already gone: what it brings back is live from op e + 1 on.
        release = max(releases) + 1
        if life.cached:  # autocast's cache holds it to the end of the forward and loss
            release = max(release, profile.forward_end_event + 1)
        if release >= death:
            continue
        targets = (change, head_change) if life.head else (change,)
        for row in targets:
            row[release] -= life.nbytes
            row[death] += life.nbytes
        live_until = release
        for start, end in sorted((max(s, release), min(e, death)) for s, e in windows):
            start = max(start, live_until)
            if start < end:
                for row in targets:
                    row[start] += life.nbytes
                    row[end] -= life.nbytes
                live_until = end
        host_bytes += life.nbytes if copies else 0  # units saving one storage share a copy
    # a checkpoint keeps inputs eager autograd frees in forward: per storage (one may feed
    # several units, HF's position ids), over the union of its recomputing holders' windows,
    # beyond where eager holds it anyway
    for life in profile.unsaved_inputs or _per_unit_inputs(profile):
        windows, offloaded = [], False
        for fqn in life.units:
            action = actions.get(fqn, "keep")
            _, fwd_end, bwd_start, bwd_end = units[fqn].window(0)  # the first call's inputs
            if action not in RECOMPUTING or bwd_start < 0:
                continue
            if members.get(segments.get(fqn, -1), [fqn])[0] != fqn:
                continue  # inside a segment: the segment's recompute brings it back
            start, end = fwd_end + 1, min(max(bwd_end, bwd_start) + 1, profile.num_events)
            if action == "recompute+offload" and life.nbytes >= min_offload_bytes:
                start, offloaded = prefetched(fqn) + 1, True
            windows.append((start, end))
        host_bytes += life.nbytes if offloaded else 0
        targets = (change, head_change) if profile.head_unit in life.units else (change,)
        covered = life.death + 1
        for start, end in sorted(windows):
            start = max(start, covered)
            if start < end:
                for row in targets:
                    row[start] += life.nbytes
                    row[end] -= life.nbytes
                covered = end
    if profile.rng_state_bytes:
        _stash_rng_states(profile, actions, segments, members, change)
    total = total + np.cumsum(change[:-1])
    spikes = np.zeros(profile.num_events, dtype=np.int64)  # recompute transients
    head_spikes = np.zeros(profile.num_events, dtype=np.int64)
    extra_s = transfer_s = exposed_s = 0.0
    seconds = cost.unit_seconds(profile)
    for fqn, action in actions.items():
        unit = units[fqn]
        compute_s = seconds[fqn]
        if action in RECOMPUTING:
            # a unit inside a segment runs forward twice more: outer and inner recompute
            extra_s += compute_s * (2 if fqn in segments else 1)
            # what it holds besides the saved tensors it re-creates, up to where it stops (its
            # ops' own scratch included, op by op)
            spike = max(unit.recompute_peak_bytes - internal.get(fqn, 0), 0)
            if unit.recompute_peak_bytes < 0:  # not recorded: its forward's, less its outputs
                spike = max(unit.temp_peak_bytes - internal.get(fqn, 0) - unit.output_bytes, 0)
                spike += _forward_scratch(profile, unit)  # and its largest scratch on top
            # the recompute snapshots running statistics (once more for a segment's outer pass)
            spike += unit.norm_state_bytes * (2 if fqn in segments else 1)
            # the recompute forks the generator: one more state held while it runs
            spike += profile.rng_state_bytes
            for call in range(max(len(unit.calls), 1)):  # each call recomputes in its backward
                bwd_start = unit.window(call)[2]
                if 0 <= bwd_start < profile.num_events - 1:
                    spikes[bwd_start + 1] += spike
                    if fqn == profile.head_unit:
                        head_spikes[bwd_start + 1] += spike
        moved = {"offload": unit.saved_bytes, "recompute+offload": inputs.get(fqn, 0)}
        if action in moved:
            # the copy out overlaps this unit's forward, the prefetch the backward of the next
            # one (two units of backward ~ 2x forward): only the excess is exposed
            out_s, in_s = cost.copy_s(moved[action]), cost.fetch_s(moved[action])
            transfer_s += out_s + in_s
            exposed_s += max(0.0, out_s - compute_s) + max(0.0, in_s - 2 * compute_s)
    optimizer_copy_s = 0.0
    if host_state is not None:
        # the state goes out and comes back on two streams beside the whole backward (~2x the
        # forward compute): only the excess of either direction is exposed
        backward_s = 2 * sum(seconds.values())
        out_s, in_s = cost.copy_s(host_state.copied_bytes), cost.fetch_s(host_state.copied_bytes)
        optimizer_copy_s = out_s + in_s
        transfer_s += optimizer_copy_s
        exposed_s += max(0.0, out_s - backward_s) + max(0.0, in_s - backward_s)
    host_optimizer_bytes = 0
    if host_optimizer:
        copy_s, exposed, host_optimizer_bytes = host_optimizer_cost(profile, cost)
        optimizer_copy_s = copy_s
        transfer_s += copy_s
        exposed_s += exposed
    # NOTE: a segment's outer recompute holds the inner inputs plus one inner unit's internals
    # at a time, less than what the last unit's own recompute holds right after it: no spike.
    total = total + spikes
    peak_event = int(total.argmax()) if total.size else -1
    breakdown = dict.fromkeys(BREAKDOWN, 0)
    if peak_event >= 0:
        at = peak_event
        shifted, head_shifted = int(np.cumsum(change)[at]), int(np.cumsum(head_change)[at])
        live = {name: int(table[i, at]) for i, name in enumerate(CATEGORIES)}
        breakdown.update(
            params=live["params"],
            grads=live["grads"],
            optimizer=live["optimizer"],
            activations=live["saved"] - int(head[0, at]) + shifted - head_shifted,
            head_loss=int(head[0, at] + head[1, at]) + head_shifted + int(head_spikes[at]),
            temporaries=live["temporaries"] - int(head[1, at]) + int(spikes[at] - head_spikes[at]),
        )
    return Outcome(
        int(total.max(initial=0)),
        host_bytes,
        extra_s,
        transfer_s,
        exposed_s,
        peak_event,
        host_state.host_bytes if host_state is not None else host_optimizer_bytes,
        optimizer_copy_s,
        breakdown=breakdown,
        peak_at=locate(profile, peak_event),
    )


def _forward_scratch(profile: Profile, unit: Any) -> int:
    """The largest scratch an op of the unit's forward allocated for itself."""
    windows = [unit.window(c)[:2] for c in range(max(len(unit.calls), 1))]
    return max(
        (b for e, b in profile.scratch if any(s <= e <= end for s, end in windows)), default=0
    )


def _stash_rng_states(
    profile: Profile,
    actions: dict[str, str],
    segments: dict[str, int],
    members: dict[int, list[str]],
    change: np.ndarray,
) -> None:
    """Each checkpointed call keeps the generator state it will replay (``preserve_rng_state``)
    from its forward until its backward is over; a segment's outer checkpoint one more."""
    units = {u.fqn: u for u in profile.units}
    spans = []
    for fqn, action in actions.items():
        if action not in RECOMPUTING:
            continue
        unit = units[fqn]
        for call in range(max(len(unit.calls), 1)):
            fwd_start, _, bwd_start, bwd_end = unit.window(call)
            spans.append((fwd_start, max(bwd_end, bwd_start)))
        group = members.get(segments.get(fqn, -1), [])
        if group and group[0] == fqn:
            spans.append((unit.fwd_start_event, max(unit.bwd_end_event, unit.bwd_start_event)))
    for start, end in spans:
        if 0 <= start <= end:
            change[start] += profile.rng_state_bytes
            change[min(end + 1, profile.num_events)] -= profile.rng_state_bytes


def _per_unit_inputs(profile: Profile) -> list[StorageLife]:
    """Profiles that did not record their unsaved input storages: one per unit, freed by
    eager right after the unit's forward."""
    return [
        StorageLife(u.unsaved_input_bytes, u.fwd_start_event, u.fwd_end_event, (u.fqn,))
        for u in profile.units
        if u.unsaved_input_bytes > 0
    ]


def segment_runs(profile: Profile, actions: dict[str, str]) -> dict[str, int]:
    """Group runs of consecutive sibling recompute units into segments of ~sqrt(run) units.

    Memory-centric recomputation (SuperNeurons §3.3) with Chen et al.'s sqrt(n) segment size:
    a run of L blocks holds L/k segment inputs plus k inner inputs while one segment recomputes.
    """
    runs: list[list[str]] = []
    previous: tuple[str, int] | None = None
    for unit in profile.units:
        parent, _, name = unit.fqn.rpartition(".")
        key = (parent, int(name)) if name.isdigit() else None
        if actions.get(unit.fqn) != "recompute" or key is None or not unit.in_sequential:
            previous = None
            continue
        if previous is not None and previous[0] == parent and previous[1] + 1 == key[1]:
            runs[-1].append(unit.fqn)
        else:
            runs.append([unit.fqn])
        previous = key
    segments: dict[str, int] = {}
    for run in runs:
        if len(run) < 3:
            continue
        size = max(2, round(math.sqrt(len(run))))
        for start in range(0, len(run), size):
            chunk = run[start : start + size]
            if len(chunk) >= 2:
                segment_id = len({*segments.values()})
                segments.update(dict.fromkeys(chunk, segment_id))
    return segments
