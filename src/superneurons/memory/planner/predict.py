"""Predict a plan's device peak and cost from a Profile (pure; no tensors are touched).

Given per-unit actions (keep / offload / recompute / recompute+offload), :func:`evaluate`
replays the profile's measured live intervals, call by call (a module called several times in
one forward has one window per call): a storage saved only by non-keep units is absent
between the end of its units' forward call and their backward (recompute) or the prefetch one unit
ahead (offload, and the checkpoint of recompute+offload); a plain checkpoint's input stays;
recompute adds its transient forward bytes at the unit's backward start.
``optimizer_in_backward`` frees each gradient as soon as it is applied, so the gradient row of
the timeline and the step phase drop to the largest single gradient. :class:`CostModel` turns
FLOPs, bytes and copies into seconds; ``segments`` are the memory-centric segments the search
forms (:func:`~superneurons.memory.planner.strategy_search.segment_runs`; SuperNeurons, Wang
et al., PPoPP'18 §3.3). ``host_optimizer``
keeps no optimizer state on the device and each gradient only until its bucket is drained
(:func:`superneurons.memory.planner.buckets.bucket_timeline`).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from superneurons.memory.plan import OFFLOADING, RECOMPUTING, TrainingStep
from superneurons.memory.planner.cost import MIN_OFFLOAD_BYTES, CostModel
from superneurons.memory.planner.predict_steps import (
    HostStateModel,
    accumulated_gradients,
    host_optimizer_cost,
    host_state_timeline,
    step_in_backward,
    step_on_host,
)
from superneurons.memory.planner.weights import (
    WeightStreams,
    host_gradients,
    stream_cost,
    weight_windows,
)
from superneurons.memory.planner.where import locate
from superneurons.memory.profile_types import CATEGORIES, Profile, StorageLife, UnitProfile

__all__ = ["BREAKDOWN", "CostModel", "Outcome", "evaluate"]

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
    weights: WeightStreams = field(default_factory=WeightStreams)  # streamed units' weights


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
    streamed: frozenset[str] = frozenset(),
    step: TrainingStep | None = None,
) -> Outcome:
    """Predict peak bytes, host bytes and time overheads of per-unit ``actions`` (fqn -> action).

    ``segments`` (fqn -> segment id) groups consecutive recompute units under one outer
    checkpoint: only the first unit's input stays saved; the inner units' inputs come back when
    the segment is recomputed at the backward start of its last unit. Storages smaller than
    ``min_offload_bytes`` stay on the device, as the pool keeps them
    (:attr:`~superneurons.memory.offload.pool.PoolConfig.min_offload_bytes`).
    ``optimizer_on_host`` (with ``optimizer_in_backward``): the optimizer state lives in the
    host pool; on the device only what :func:`~superneurons.memory.planner.predict_steps.
    host_state_timeline` keeps there.
    ``host_optimizer``: the optimizer runs on the host; gradients live on the device as
    ``buckets`` (default: :func:`~superneurons.memory.planner.buckets.assign_buckets`) are
    launched and drained; after backward only the parameters remain.
    ``streamed``: the units whose weights stream from the host (with ``host_optimizer``): their
    parameters are on the device only in the windows of
    :func:`~superneurons.memory.planner.weights.weight_windows`.
    ``step``: the loop clips or accumulates (:class:`~superneurons.memory.plan.TrainingStep`;
    None: neither), which changes where gradients live and when an optimizer off the device
    may step (:mod:`superneurons.memory.planner.predict_steps`); times are then per
    micro-batch.

    The passes, over one timeline of the step: where the optimizer steps (the resident rows),
    the saved storages the plan releases and brings back, the checkpoint inputs it keeps, the
    generator states recompute stashes, the recompute transients; then the copies' time.
    """
    cost = cost or CostModel()
    plan = _Plan(profile, actions, segments or {}, min_offload_bytes)
    step = step or TrainingStep()
    timeline, host_state = _optimizer_rows(
        profile,
        optimizer_in_backward,
        optimizer_on_host,
        host_optimizer,
        buckets,
        step,
        host_gradients(profile, streamed) if host_optimizer else frozenset(),
    )
    weights = stream_cost(profile, streamed, cost, actions)
    if streamed:
        weight_windows(profile, streamed, timeline.table, actions)
    host_bytes = _move_saved(plan, timeline) + _keep_checkpoint_inputs(plan, timeline)
    if profile.rng_state_bytes:
        _stash_rng_states(profile, actions, plan.segments, plan.members, timeline.change)
    seconds = cost.unit_seconds(profile)
    extra_s = _recompute_spikes(plan, timeline, seconds)
    transfer_s, exposed_s = _activation_copies(plan, cost, seconds)
    optimizer_copy_s, optimizer_host_bytes = 0.0, 0
    if host_state is not None:
        # the state goes out and comes back on two streams beside the whole backward (~2x the
        # forward compute): only the excess of either direction is exposed
        backward_s = 2 * sum(seconds.values())
        out_s, in_s = cost.copy_s(host_state.copied_bytes), cost.fetch_s(host_state.copied_bytes)
        optimizer_copy_s = out_s + in_s
        transfer_s += optimizer_copy_s
        if step.waits:  # after backward, each state's fetch beside the previous one's return
            exposed_s += max(out_s, in_s) / step.accumulation_steps
        else:
            exposed_s += max(0.0, out_s - backward_s) + max(0.0, in_s - backward_s)
        optimizer_host_bytes = host_state.host_bytes
    if host_optimizer:
        optimizer_copy_s, exposed, host_optimizer_bytes = host_optimizer_cost(profile, cost, step)
        transfer_s += optimizer_copy_s
        exposed_s += exposed
        if host_state is None:
            optimizer_host_bytes = host_optimizer_bytes
    total = timeline.total()
    peak_event = int(total.argmax()) if total.size else -1
    return Outcome(
        int(total.max(initial=0)),
        host_bytes,
        extra_s,
        transfer_s + weights.transfer_s,
        exposed_s + weights.exposed_s,
        peak_event,
        optimizer_host_bytes,
        optimizer_copy_s,
        breakdown=timeline.breakdown(peak_event),
        peak_at=locate(profile, peak_event),
        weights=weights,
    )


@dataclass
class _Timeline:
    """The predicted live device bytes of the step, event by event: the profile's rows as the
    optimizer placement leaves them (``table``), what the plan moves (``change``, a difference
    array: ``+n`` at the event a storage is live again, ``-n`` where it goes) and the recompute
    transients (``spikes``); the LM head + loss part of each apart (``head*``: the breakdown's
    ``head_loss``)."""

    table: np.ndarray  # (len(CATEGORIES), E)
    head: np.ndarray  # (2, E): saved, temporaries of the LM head + loss, inside table
    change: np.ndarray  # (E + 1,)
    head_change: np.ndarray  # (E + 1,)
    spikes: np.ndarray  # (E,)
    head_spikes: np.ndarray  # (E,)

    def live(self, intervals: list[tuple[int, int, int, bool]]) -> None:
        """Each ``(nbytes, start, end, head)``: ``nbytes`` more live from event ``start`` to
        ``end`` (exclusive), in the LM head's rows too where ``head``. One unbuffered add per
        row for them all (integers: the order of the adds changes no bit)."""
        if not intervals:
            return
        nbytes, starts, ends, heads = np.array(intervals, dtype=np.int64).T
        heads = heads.astype(bool)
        np.add.at(self.change, starts, nbytes)
        np.add.at(self.change, ends, -nbytes)
        if heads.any():
            np.add.at(self.head_change, starts[heads], nbytes[heads])
            np.add.at(self.head_change, ends[heads], -nbytes[heads])

    def total(self) -> np.ndarray:
        return self.table.sum(axis=0) + np.cumsum(self.change[:-1]) + self.spikes

    def breakdown(self, at: int) -> dict[str, int]:
        """The live bytes at event ``at`` by :data:`BREAKDOWN` (they sum to the total there)."""
        breakdown = dict.fromkeys(BREAKDOWN, 0)
        if at < 0:
            return breakdown
        head, spikes, head_spikes = self.head, self.spikes, self.head_spikes
        shifted = int(np.cumsum(self.change)[at])
        head_shifted = int(np.cumsum(self.head_change)[at])
        live = {name: int(self.table[i, at]) for i, name in enumerate(CATEGORIES)}
        breakdown.update(
            params=live["params"],
            grads=live["grads"],
            optimizer=live["optimizer"],
            activations=live["saved"] - int(head[0, at]) + shifted - head_shifted,
            head_loss=int(head[0, at] + head[1, at]) + head_shifted + int(head_spikes[at]),
            temporaries=live["temporaries"] - int(head[1, at]) + int(spikes[at] - head_spikes[at]),
        )
        return breakdown


def _optimizer_rows(
    profile: Profile,
    in_backward: bool,
    on_host: bool,
    host_optimizer: bool,
    buckets: tuple[tuple[str, ...], ...] | None,
    step: TrainingStep,
    host_grads: frozenset[str] = frozenset(),
) -> tuple[_Timeline, HostStateModel | None]:
    """The step's eager rows with the optimizer where the plan steps it: in backward (each
    gradient freed once applied), its state in the host pool, or on the host; gradients
    accumulated on the device where the step accumulates and the optimizer is not the host's
    (which keeps the sums in host buffers)."""
    table = profile.timeline_array(steady_state=True)
    head = profile.head_rows()  # (saved, temporaries) of the LM head + loss, inside table
    if step.accumulation_steps > 1 and not host_optimizer:
        accumulated_gradients(table, profile)
    if in_backward:
        step_in_backward(table, head, profile, step)
    if host_optimizer:
        step_on_host(table, head, profile, buckets, step, host_grads)
    host_state = None
    if in_backward and on_host:
        # NOTE: timed by the gradients' births, not their hooks: measured here, the fetched state
        # of the first large parameter of backward is live from its gradient's birth (the
        # executed peak equals this model's on the zoo GPT's plans, test_memory_optim_host)
        host_state = host_state_timeline(
            profile.grad_births,
            profile.optimizer_state_bytes,
            profile.num_events,
            after_event=profile.backward_end_event if step.waits else None,
        )
        table[CATEGORIES.index("optimizer")] = host_state.device_row
    events = profile.num_events
    zeros = functools.partial(np.zeros, dtype=np.int64)
    timeline = _Timeline(
        table, head, zeros(events + 1), zeros(events + 1), zeros(events), zeros(events)
    )
    return timeline, host_state


@dataclass(frozen=True)
class _Shared:
    """What every evaluation of one profile shares, whatever the actions (:func:`_shared`):
    the unit calls, their forward order, the saved storages a plan may move and the saved
    bytes born inside each unit."""

    units: dict[str, UnitProfile]
    # one window per forward call of each unit, in forward order (a module called several
    # times saves, releases and gets back each call's tensors separately: one pool group each)
    calls: dict[tuple[str, int], tuple[int, int, int, int]]
    next_call: dict[tuple[str, int], tuple[str, int]]
    # saved only by units, not held by the caller (an input, an output: moving it frees nothing)
    movable: tuple[StorageLife, ...]
    # per unit, the saved bytes born inside it (its recompute re-creates them) and those born
    # before it (its checkpoint)
    born_inside: tuple[dict[str, int], dict[str, int]]

    @classmethod
    def of(cls, profile: Profile) -> _Shared:
        units = {u.fqn: u for u in profile.units}
        calls = {
            (u.fqn, c): u.window(c) for u in profile.units for c in range(max(len(u.calls), 1))
        }
        order = sorted(calls, key=lambda k: calls[k][0])
        movable = tuple(
            life
            for life in profile.storages
            if "" not in life.units and not life.from_caller and life.death < profile.num_events - 1
        )
        internal: dict[str, int] = {}
        inputs: dict[str, int] = {}
        for life in profile.storages:
            for f in life.units:
                if f and life.birth >= units[f].window(life.call_of(f))[0]:
                    internal[f] = internal.get(f, 0) + life.nbytes
                elif f:
                    inputs[f] = inputs.get(f, 0) + life.nbytes
        return cls(
            units,
            calls,
            dict(zip(order, order[1:], strict=False)),
            movable,
            (internal, inputs),
        )


_SHARED: dict[int, _Shared] = {}


def _shared(profile: Profile) -> _Shared:
    """:class:`_Shared` of ``profile``, made at its first evaluation and dropped with it (a
    search evaluates one profile about a thousand times)."""
    key = id(profile)
    shared = _SHARED.get(key)
    if shared is None:
        shared = _SHARED[key] = _Shared.of(profile)
        weakref.finalize(profile, _SHARED.pop, key, None)
    return shared


class _Plan:
    """The actions being evaluated, with the unit calls they act on: each call's window, the
    next call in forward order, and where backward enters and leaves it (what the runtime's
    prefetch follows, ``memory.nodes``)."""

    def __init__(
        self,
        profile: Profile,
        actions: dict[str, str],
        segments: dict[str, int],
        min_offload_bytes: int,
    ) -> None:
        self.profile, self.actions, self.segments = profile, actions, segments
        self.min_offload_bytes = min_offload_bytes
        self.shared = _shared(profile)
        self.units, self.calls = self.shared.units, self.shared.calls
        self.next_call = self.shared.next_call
        self.born_inside = self.shared.born_inside
        self.members: dict[int, list[str]] = {}  # segment id -> its units, in forward order
        for fqn in (u.fqn for u in profile.units):
            if fqn in segments:
                self.members.setdefault(segments[fqn], []).append(fqn)

    def leads(self, fqn: str) -> bool:
        """``fqn`` is not inside a segment, or is its first unit (whose input stays saved)."""
        return self.members.get(self.segments.get(fqn, -1), [fqn])[0] == fqn

    def edge(self, key: tuple[str, int], side: int) -> int:
        """Where backward entered (side 0) or left (1) a unit call's output nodes, measured by
        the profile; never entered: its first unpack; never left: -1."""
        unit, call = self.units[key[0]], key[1]
        measured = unit.edges[call][side] if call < len(unit.edges) else -1
        return measured if measured >= 0 or side else self.calls[key][2]

    def prefetched(self, fqn: str, call: int = 0) -> int:
        """Where the runtime prefetches a call's pool group: where backward enters the next unit
        call in forward order if that one is offloaded too (for a recompute+offload one: where
        backward leaves its output nodes, after the recompute they triggered), else where
        backward enters the call itself."""
        bwd = self.edge((fqn, call), 0)
        nxt = self.next_call.get((fqn, call))
        if nxt is not None and self.actions.get(nxt[0], "") in OFFLOADING:
            ahead = self.edge(nxt, 1 if self.actions[nxt[0]] == "recompute+offload" else 0)
            bwd = ahead if 0 <= ahead < bwd else bwd
        return bwd


def _move_saved(plan: _Plan, timeline: _Timeline) -> int:
    """Release each saved storage that only non-keep units saved after their forward, and
    make it live again where it comes back (prefetched, or re-created by a recompute). Returns
    the host bytes the copies take (units saving one storage share a copy)."""
    profile, host_bytes, intervals = plan.profile, 0, []
    for life in plan.shared.movable:
        if any(plan.actions.get(f, "keep") == "keep" for f in life.units):
            continue
        moved = _comes_back(plan, life)
        if moved is None:
            continue
        releases, windows, copies = moved
        # NOTE: an unpack at event e happens after op e, when the storages that died at e are
        # already gone: what it brings back is live from op e + 1 on.
        release, death = max(releases) + 1, life.death + 1
        if life.cached:  # autocast's cache holds it to the end of the forward and loss
            release = max(release, profile.forward_end_event + 1)
        if release >= death:
            continue
        intervals.append((-life.nbytes, release, death, life.head))
        live_until = release
        for start, end in sorted((max(s, release), min(e, death)) for s, e in windows):
            start = max(start, live_until)
            if start < end:
                intervals.append((life.nbytes, start, end, life.head))
                live_until = end
        host_bytes += life.nbytes if copies else 0
    timeline.live(intervals)
    return host_bytes


def _comes_back(
    plan: _Plan, life: StorageLife
) -> tuple[list[int], list[tuple[int, int]], int] | None:
    """Where a saved storage is released (an event per unit that saved it), the ``(start,
    end)`` windows where it lives again, and how many copies the pool makes; None: the plan
    keeps it where it is. A prefetched checkpoint lives until its unit's backward is over;
    what a recompute re-creates is a new storage that lives until the eager death, as does
    what a prefetch brings back."""
    releases, windows, copies = [], [], 0
    death = life.death + 1
    # the pool keeps it where it is: too small to be worth a copy, or saved as a broadcast
    small = life.nbytes < plan.min_offload_bytes or life.pool_keeps
    for f in life.units:
        action, call = plan.actions[f], life.call_of(f)
        fwd_start, fwd_end, bwd_start, bwd_end = plan.units[f].window(call)
        if action in RECOMPUTING and life.birth < fwd_start:
            group = plan.members.get(plan.segments.get(f, -1), [f])
            if group[0] != f:  # an inner input of a segment: the segment recomputes it
                releases.append(plan.units[group[-1]].fwd_end_event)
                windows.append((plan.units[group[-1]].bwd_start_event + 1, death))
                continue
            if action == "recompute" or small:
                return None  # a checkpoint's input stays saved
            releases.append(fwd_end)  # the checkpoint goes to the host pool
            windows.append((plan.prefetched(f, call) + 1, max(bwd_end, bwd_start) + 2))
            copies += 1
            continue
        if action == "offload" and small:
            return None
        releases.append(fwd_end)
        if action == "offload":
            windows.append((plan.prefetched(f, call) + 1, death))
            copies += 1  # the pool copies it once, whichever units saved it
        else:
            windows.append((bwd_start + 1, death))  # recomputed
    return releases, windows, copies


def _keep_checkpoint_inputs(plan: _Plan, timeline: _Timeline) -> int:
    """A checkpoint keeps inputs eager autograd frees in forward: per storage (one may feed
    several units, HF's position ids), over the union of its recomputing holders' windows,
    beyond where eager holds it anyway. Returns the host bytes of those recompute+offload
    sends to the host pool."""
    profile, host_bytes, intervals = plan.profile, 0, []
    for life in profile.unsaved_inputs or _per_unit_inputs(profile):
        windows, offloaded = [], False
        for fqn in life.units:
            action = plan.actions.get(fqn, "keep")
            _, fwd_end, bwd_start, bwd_end = plan.units[fqn].window(0)  # the first call's inputs
            if action not in RECOMPUTING or bwd_start < 0:
                continue
            if not plan.leads(fqn):
                continue  # inside a segment: the segment's recompute brings it back
            start, end = fwd_end + 1, min(max(bwd_end, bwd_start) + 1, profile.num_events)
            if action == "recompute+offload" and life.nbytes >= plan.min_offload_bytes:
                start, offloaded = plan.prefetched(fqn) + 1, True
            windows.append((start, end))
        host_bytes += life.nbytes if offloaded else 0
        covered = life.death + 1
        for start, end in sorted(windows):
            start = max(start, covered)
            if start < end:
                intervals.append((life.nbytes, start, end, profile.head_unit in life.units))
                covered = end
    timeline.live(intervals)
    return host_bytes


def _recompute_spikes(plan: _Plan, timeline: _Timeline, seconds: dict[str, float]) -> float:
    """Each recomputed call holds its transient forward bytes at its backward start; returns
    the recompute's extra compute time."""
    profile, extra_s = plan.profile, 0.0
    internal, _ = plan.born_inside
    for fqn, action in plan.actions.items():
        if action not in RECOMPUTING:
            continue
        unit = plan.units[fqn]
        # a unit inside a segment runs forward twice more: outer and inner recompute
        extra_s += seconds[fqn] * (2 if fqn in plan.segments else 1)
        # what it holds besides the saved tensors it re-creates, up to where it stops (its
        # ops' own scratch included, op by op)
        spike = max(unit.recompute_peak_bytes - internal.get(fqn, 0), 0)
        if unit.recompute_peak_bytes < 0:  # not recorded: its forward's, less its outputs
            spike = max(unit.temp_peak_bytes - internal.get(fqn, 0) - unit.output_bytes, 0)
            spike += _forward_scratch(profile, unit)  # and its largest scratch on top
        # the recompute snapshots running statistics (once more for a segment's outer pass)
        spike += unit.norm_state_bytes * (2 if fqn in plan.segments else 1)
        # the recompute forks the generator: one more state held while it runs
        spike += profile.rng_state_bytes
        for call in range(max(len(unit.calls), 1)):  # each call recomputes in its backward
            bwd_start = unit.window(call)[2]
            if 0 <= bwd_start < profile.num_events - 1:
                timeline.spikes[bwd_start + 1] += spike
                if fqn == profile.head_unit:
                    timeline.head_spikes[bwd_start + 1] += spike
    # NOTE: a segment's outer recompute holds the inner inputs plus one inner unit's internals
    # at a time, less than what the last unit's own recompute holds right after it: no spike.
    return extra_s


def _activation_copies(
    plan: _Plan, cost: CostModel, seconds: dict[str, float]
) -> tuple[float, float]:
    """``(transfer_s, exposed_s)`` of the activations the plan sends to the host pool: the
    copy out overlaps the unit's forward, the prefetch the backward of the next one (two units
    of backward ~ 2x forward): only the excess is exposed."""
    _, inputs = plan.born_inside
    transfer_s = exposed_s = 0.0
    for fqn, action in plan.actions.items():
        unit, compute_s = plan.units[fqn], seconds[fqn]
        moved = {"offload": unit.saved_bytes, "recompute+offload": inputs.get(fqn, 0)}
        if action in moved:
            out_s, in_s = cost.copy_s(moved[action]), cost.fetch_s(moved[action])
            transfer_s += out_s + in_s
            exposed_s += max(0.0, out_s - compute_s) + max(0.0, in_s - 2 * compute_s)
    return transfer_s, exposed_s


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
