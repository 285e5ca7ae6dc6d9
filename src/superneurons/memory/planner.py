"""The cost-aware planner: Profile + byte budget -> Plan (pure; no tensors are touched).

Rules (SuperNeurons, Wang et al., PPoPP'18 §3.2-3.3), then a greedy improvement:

* **offload** the saved activations of compute-heavy units (conv, matmul): their forward hides the
  copy to the host and the backward of the unit after them hides the prefetch (the runtime
  prefetches one unit ahead), so the exposed cost is ``max(0, copy_s - compute_s)``;
* **recompute** cheap units (BN, activations, pooling): cost is their forward time, from FLOPs and
  bytes written under a roofline (or measured, for real profiles);
* candidates are taken in ascending *cost per byte saved* (the DTR heuristic of Kirisame et al.,
  ICLR'21, applied offline) until the predicted peak fits the budget. The chosen plan is the shortest
  prefix that fits, so the predicted peak never rises when the budget falls.

The peak under a plan is predicted from the profile's measured live intervals: a storage saved only
by non-keep units is absent between the end of its units' forward and their backward (recompute)
or the prefetch one unit ahead (offload); checkpoint inputs stay; recompute adds its transient
forward bytes at the unit's backward start. ``optimizer_in_backward`` frees each gradient as soon as
it is applied (``register_post_accumulate_grad_hook``), so the gradient row of the timeline and the
step phase drop to the largest single gradient.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from superneurons.bytesize import format_bytes
from superneurons.errors import ConfigError
from superneurons.memory.plan import (
    STRATEGIES,
    InfeasibleBudgetError,
    Plan,
    TensorDecision,
    UnitDecision,
)
from superneurons.memory.profile_types import CATEGORIES, Profile, UnitProfile

__all__ = ["CostModel", "evaluate", "make_plan", "min_peak_bytes"]

logger = logging.getLogger("superneurons.memory")


@dataclass(frozen=True)
class CostModel:
    """Device speeds the planner converts work into seconds with.

    Defaults: PCIe 4.0 x16 at ~25 GB/s effective host<->device; an A100's datasheet fp32 rate
    (19.5 TFLOP/s) and HBM bandwidth (1.55 TB/s) for recompute. Pass the target's figures.
    """

    bandwidth_bytes_per_s: float = 25e9
    flops_per_s: float = 19.5e12
    memory_bandwidth_bytes_per_s: float = 1.55e12

    def __post_init__(self) -> None:
        for name in ("bandwidth_bytes_per_s", "flops_per_s", "memory_bandwidth_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    def compute_s(self, unit: UnitProfile, *, fake: bool) -> float:
        """Forward time of ``unit``: measured for real profiles, a roofline for fake ones."""
        roofline_s = max(
            unit.flops / self.flops_per_s, unit.bytes_written / self.memory_bandwidth_bytes_per_s
        )
        return roofline_s if fake else max(unit.fwd_time_s, roofline_s)

    def copy_s(self, nbytes: int) -> float:
        return nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class _Outcome:
    peak_bytes: int
    host_bytes: int
    extra_compute_s: float
    transfer_s: float
    exposed_s: float


def evaluate(
    profile: Profile,
    actions: dict[str, str],
    *,
    optimizer_in_backward: bool = False,
    cost: CostModel | None = None,
    segments: dict[str, int] | None = None,
) -> _Outcome:
    """Predict peak bytes, host bytes and time overheads of per-unit ``actions`` (fqn -> action).

    ``segments`` (fqn -> segment id) groups consecutive recompute units under one outer
    checkpoint: only the first unit's input stays saved; the inner units' inputs come back when
    the segment is recomputed at the backward start of its last unit.
    """
    cost = cost or CostModel()
    segments = segments or {}
    table = profile.timeline_array(steady_state=True)
    if optimizer_in_backward:
        table[CATEGORIES.index("grads")] = 0
        table[:, profile.backward_end_event + 1 :] = 0
        table[CATEGORIES.index("params"), profile.backward_end_event + 1 :] = table[0, 0]
        table[CATEGORIES.index("optimizer"), profile.backward_end_event + 1 :] = table[2, 0]
        # each gradient lives one op: the post-accumulate hook steps its parameter (in place,
        # as SGD/Adam do per parameter) and frees it at once
        for birth, nbytes in profile.grad_births:
            table[CATEGORIES.index("grads"), min(birth, profile.num_events - 1)] += nbytes
    total = table.sum(axis=0)
    change = np.zeros(profile.num_events + 1, dtype=np.int64)
    units = {u.fqn: u for u in profile.units}
    order = [u.fqn for u in profile.units]
    next_unit = {a: b for a, b in zip(order, order[1:], strict=False)}
    members: dict[int, list[str]] = {}
    for fqn in order:
        if fqn in segments:
            members.setdefault(segments[fqn], []).append(fqn)
    host_bytes = 0
    internal: dict[str, int] = {}  # saved bytes born inside each unit (its recompute re-creates)
    for life in profile.storages:
        for f in life.units:
            if f and life.birth >= units[f].fwd_start_event:
                internal[f] = internal.get(f, 0) + life.nbytes
    for life in profile.storages:
        packers = life.units
        if "" in packers or any(actions.get(f, "keep") == "keep" for f in packers):
            continue
        if life.birth == 0 or life.death >= profile.num_events - 1:
            continue  # the caller holds it (an input, an output): moving it frees nothing
        releases, restores, held = [], [], False
        for f in packers:
            unit = units[f]
            if actions[f] == "recompute" and life.birth < unit.fwd_start_event:
                group = members.get(segments.get(f, -1), [f])
                if group[0] == f:
                    held = True  # a checkpoint's input stays saved
                    break
                releases.append(units[group[-1]].fwd_end_event)
                restores.append(units[group[-1]].bwd_start_event)
                continue
            releases.append(unit.fwd_end_event)
            bwd = unit.bwd_start_event
            # the runtime prefetches a unit when backward enters the next one if that one is
            # offloaded too (its autograd pre-hook), else when backward enters the unit itself
            if actions[f] == "offload" and actions.get(next_unit.get(f, ""), "") == "offload":
                ahead = units[next_unit[f]].bwd_start_event
                bwd = ahead if 0 <= ahead < bwd else bwd
            restores.append(bwd)
        if held:
            continue
        release = max(releases) + 1
        # NOTE: an unpack at event e happens after op e, when the storages that died at e are
        # already gone: what it brings back is live from op e + 1 on.
        restore = min(min(restores) + 1, life.death + 1)
        if restore <= release:
            continue
        change[release] -= life.nbytes
        change[restore] += life.nbytes
        if any(actions[f] == "offload" for f in packers):
            host_bytes += life.nbytes
    total = total + np.cumsum(change[:-1])
    extra_s = transfer_s = exposed_s = 0.0
    for fqn, action in actions.items():
        unit = units[fqn]
        compute_s = cost.compute_s(unit, fake=profile.fake)
        if action == "recompute":
            # a unit inside a segment runs forward twice more: outer and inner recompute
            extra_s += compute_s * (2 if fqn in segments else 1)
            spike = max(unit.temp_peak_bytes - internal.get(fqn, 0) - unit.output_bytes, 0)
            if 0 <= unit.bwd_start_event < profile.num_events - 1:
                total[unit.bwd_start_event + 1] += spike
        elif action == "offload":
            copy_s = cost.copy_s(unit.saved_bytes)
            transfer_s += 2 * copy_s
            exposed_s += max(0.0, copy_s - compute_s) + max(0.0, copy_s - 2 * compute_s)
    # NOTE: a segment's outer recompute holds the inner inputs plus one inner unit's internals
    # at a time, less than what the last unit's own recompute holds right after it: no spike.
    return _Outcome(int(total.max(initial=0)), host_bytes, extra_s, transfer_s, exposed_s)


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
        if actions.get(unit.fqn) != "recompute" or key is None:
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


def _candidates(
    profile: Profile, allowed: tuple[str, ...], cost: CostModel
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(fqn, action) steps in ascending cost per byte saved, then the recompute->offload
    upgrades (offload-capable strategies) that give the smallest peak."""
    steps: list[tuple[float, str, str]] = []
    upgrades: list[tuple[float, str, str]] = []
    for unit in profile.units:
        if unit.saved_bytes == 0 or not allowed:
            continue
        compute_s = cost.compute_s(unit, fake=profile.fake)
        copy_s = cost.copy_s(unit.saved_bytes)
        options = {}
        if "recompute" in allowed:
            options["recompute"] = compute_s
        if "offload" in allowed:
            options["offload"] = max(0.0, copy_s - compute_s) + max(0.0, copy_s - 2 * compute_s)
            options["offload"] += 1e-3 * copy_s  # NOTE: tie-break: host bandwidth is not free
        action = min(options, key=lambda a: options[a])
        steps.append((options[action] / unit.saved_bytes, unit.fqn, action))
        if action == "recompute" and "offload" in options:
            upgrades.append((options["offload"] / unit.saved_bytes, unit.fqn, "offload"))
    return [(f, a) for _, f, a in sorted(steps)], [(f, a) for _, f, a in sorted(upgrades)]


_ALLOWED: dict[str, tuple[str, ...]] = {
    "eager": (),
    "recompute": ("recompute",),
    "offload": ("recompute", "offload"),
    "offload+opt-in-backward": ("recompute", "offload"),
}


_SEGMENT: tuple[str, str] = ("", "segment")  # the step that turns on memory-centric segments


@dataclass
class _Choice:
    actions: dict[str, str]
    segments: dict[str, int]
    optimizer_in_backward: bool
    outcome: _Outcome


def _search(profile: Profile, strategy: str, budget_bytes: int | None, cost: CostModel) -> _Choice:
    """Shortest candidate prefix that fits ``budget_bytes`` (None: the prefix with least peak)."""
    opt_in = strategy == "offload+opt-in-backward"
    if strategy == "checkpoint":
        actions = {u.fqn: "recompute" for u in profile.units}
        return _Choice(actions, {}, False, evaluate(profile, actions, cost=cost))
    actions = {u.fqn: "keep" for u in profile.units}
    first, upgrades = _candidates(profile, _ALLOWED[strategy], cost)
    segment: list[tuple[str, str]] = [_SEGMENT] if "recompute" in _ALLOWED[strategy] else []
    steps = first + segment + upgrades
    segmented = False

    def outcome_of() -> _Outcome:
        segments = segment_runs(profile, actions) if segmented else {}
        return evaluate(
            profile, actions, optimizer_in_backward=opt_in, cost=cost, segments=segments
        )

    def choice(outcome: _Outcome) -> _Choice:
        segments = segment_runs(profile, actions) if segmented else {}
        return _Choice(dict(actions), segments, opt_in, outcome)

    outcome = outcome_of()
    best = choice(outcome)
    for fqn, action in steps:
        if budget_bytes is not None and outcome.peak_bytes <= budget_bytes:
            return choice(outcome)
        if (fqn, action) == _SEGMENT:
            segmented = True
        else:
            actions[fqn] = action
        outcome = outcome_of()
        if outcome.peak_bytes < best.outcome.peak_bytes:
            best = choice(outcome)
    return best if budget_bytes is None else choice(outcome)


def min_peak_bytes(profile: Profile, *, cost: CostModel | None = None) -> dict[str, int]:
    """The smallest predicted peak each strategy reaches (strategy -> bytes)."""
    cost = cost or CostModel()
    return {
        s: _search(profile, s, None, cost).outcome.peak_bytes for s in STRATEGIES if s != "auto"
    }


def make_plan(
    profile: Profile,
    *,
    budget_bytes: int,
    strategy: str = "auto",
    bandwidth_bytes_per_s: float = 25e9,
    optimizer_in_backward: bool = False,
    allow_optimizer_in_backward: bool = True,
    cost: CostModel | None = None,
) -> Plan:
    """Plan keep / offload / recompute per unit so the predicted peak fits ``budget_bytes``.

    ``allow_optimizer_in_backward=False`` keeps ``auto`` (and the minimum an infeasible budget
    names) to strategies that step the optimizer after backward, as DDP needs: under
    optimizer-in-backward a parameter would be stepped before its gradient is all-reduced.

    ``strategy``: ``eager`` (keep all), ``checkpoint`` (recompute every unit), ``recompute``
    (cost-aware recompute only), ``offload`` (cost-aware offload and recompute),
    ``offload+opt-in-backward`` (also step the optimizer in backward), ``auto`` (the feasible plan
    with the least exposed time, optimizer-in-backward only if nothing else fits, or if
    ``optimizer_in_backward=True``).

    Raises:
        InfeasibleBudgetError: no plan of ``strategy`` fits; the message names the minimum budget
            and the strategy that reaches it.
        ConfigError: bad strategy or budget.
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ConfigError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    cost = cost or CostModel(bandwidth_bytes_per_s=bandwidth_bytes_per_s)
    minima = min_peak_bytes(profile, cost=cost)
    if not allow_optimizer_in_backward:
        if optimizer_in_backward or strategy == "offload+opt-in-backward":
            raise ConfigError("optimizer_in_backward contradicts allow_optimizer_in_backward=False")
        minima.pop("offload+opt-in-backward", None)
    best_strategy = min(minima, key=lambda s: minima[s])
    if strategy == "auto":
        order = ["eager", "recompute", "offload", "offload+opt-in-backward"]
        if not allow_optimizer_in_backward:
            order.remove("offload+opt-in-backward")
        if optimizer_in_backward:
            order = ["offload+opt-in-backward"]
        tried = [_search(profile, s, budget_bytes, cost) for s in order]
        fits = [c for c in tried if c.outcome.peak_bytes <= budget_bytes]
        chosen = (
            min(
                fits,
                key=lambda c: (
                    c.optimizer_in_backward,
                    c.outcome.extra_compute_s + c.outcome.exposed_s,
                ),
            )
            if fits
            else min(tried, key=lambda c: c.outcome.peak_bytes)
        )
        minima["auto"] = min(minima[s] for s in order)
    else:
        chosen = _search(profile, strategy, budget_bytes, cost)
        if optimizer_in_backward and not chosen.optimizer_in_backward:
            chosen.optimizer_in_backward = True
            chosen.outcome = evaluate(
                profile,
                chosen.actions,
                optimizer_in_backward=True,
                cost=cost,
                segments=chosen.segments,
            )
    actions, outcome = chosen.actions, chosen.outcome
    if outcome.peak_bytes > budget_bytes:
        raise InfeasibleBudgetError(
            f"budget {format_bytes(budget_bytes)} is below the smallest predicted peak of strategy "
            f"{strategy!r} ({format_bytes(minima.get(strategy, outcome.peak_bytes))}); the minimum "
            f"over all strategies is {format_bytes(minima[best_strategy])} = "
            f"{minima[best_strategy]} bytes (strategy {best_strategy!r}): raise the budget, "
            "use that strategy, or shrink the batch",
            min_budget_bytes=minima[best_strategy],
            strategy=best_strategy,
        )
    unit_bytes = {u.fqn: u.saved_bytes for u in profile.units}
    tensors = tuple(
        TensorDecision(s.key, s.unit, actions.get(s.unit, "keep") if s.unit else "keep", s.nbytes)
        for s in profile.saved
    )
    return Plan(
        units=tuple(
            UnitDecision(f, a, unit_bytes[f], segment=chosen.segments.get(f, -1))
            for f, a in actions.items()
        ),
        strategy=strategy,
        budget_bytes=budget_bytes,
        optimizer_in_backward=chosen.optimizer_in_backward,
        predicted_peak_bytes=outcome.peak_bytes,
        min_budget_bytes=minima[best_strategy],
        host_bytes=outcome.host_bytes,
        extra_compute_s=outcome.extra_compute_s,
        transfer_s=outcome.transfer_s,
        feasible=True,
        tensors=tensors,
    )
