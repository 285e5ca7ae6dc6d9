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
) -> _Outcome:
    """Predict peak bytes, host bytes and time overheads of per-unit ``actions`` (fqn -> action)."""
    cost = cost or CostModel()
    table = profile.timeline_array(steady_state=True)
    if optimizer_in_backward:
        table[CATEGORIES.index("grads")] = 0
        table[:, profile.backward_end_event + 1 :] = 0
        table[CATEGORIES.index("params"), profile.backward_end_event + 1 :] = table[0, 0]
        table[CATEGORIES.index("optimizer"), profile.backward_end_event + 1 :] = table[2, 0]
        table[CATEGORIES.index("grads")] += profile.largest_param_bytes
    total = table.sum(axis=0)
    change = np.zeros(profile.num_events + 1, dtype=np.int64)
    units = {u.fqn: u for u in profile.units}
    order = [u.fqn for u in profile.units]
    next_unit = {a: b for a, b in zip(order, order[1:], strict=False)}
    host_bytes = 0
    for life in profile.storages:
        packers = life.units
        if "" in packers or any(actions.get(f, "keep") == "keep" for f in packers):
            continue
        if any(
            actions[f] == "recompute" and life.birth < units[f].fwd_start_event for f in packers
        ):
            continue  # a checkpoint's input stays saved
        release = max(units[f].fwd_end_event for f in packers) + 1
        restores = []
        for f in packers:
            bwd = units[f].bwd_start_event
            if actions[f] == "offload" and f in next_unit:
                ahead = units[next_unit[f]].bwd_start_event
                bwd = ahead if 0 <= ahead < bwd else bwd
            restores.append(bwd)
        restore = min(min(restores), life.death + 1)
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
            extra_s += compute_s
            spike = max(unit.temp_peak_bytes - unit.saved_bytes, 0)
            if 0 <= unit.bwd_start_event < profile.num_events:
                total[unit.bwd_start_event] += spike
        elif action == "offload":
            copy_s = cost.copy_s(unit.saved_bytes)
            transfer_s += 2 * copy_s
            exposed_s += max(0.0, copy_s - compute_s) + max(0.0, copy_s - 2 * compute_s)
    return _Outcome(int(total.max(initial=0)), host_bytes, extra_s, transfer_s, exposed_s)


def _candidates(
    profile: Profile, allowed: tuple[str, ...], cost: CostModel
) -> list[tuple[str, str]]:
    """(fqn, action) steps in ascending cost per byte saved; offload-capable lists end with the
    recompute->offload upgrades that give the smallest peak."""
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
    return [(f, a) for _, f, a in sorted(steps)] + [(f, a) for _, f, a in sorted(upgrades)]


_ALLOWED: dict[str, tuple[str, ...]] = {
    "eager": (),
    "recompute": ("recompute",),
    "offload": ("recompute", "offload"),
    "offload+opt-in-backward": ("recompute", "offload"),
}


def _search(
    profile: Profile, strategy: str, budget_bytes: int | None, cost: CostModel
) -> tuple[dict[str, str], bool, _Outcome]:
    """Shortest candidate prefix that fits ``budget_bytes`` (None: the full prefix)."""
    opt_in = strategy == "offload+opt-in-backward"
    if strategy == "checkpoint":
        actions = {u.fqn: "recompute" for u in profile.units}
        return actions, opt_in, evaluate(profile, actions, cost=cost)
    actions = {u.fqn: "keep" for u in profile.units}
    outcome = evaluate(profile, actions, optimizer_in_backward=opt_in, cost=cost)
    steps = _candidates(profile, _ALLOWED[strategy], cost)
    if budget_bytes is None:  # the prefix with the smallest peak of this strategy
        best = (dict(actions), outcome)
        for fqn, action in steps:
            actions[fqn] = action
            outcome = evaluate(profile, actions, optimizer_in_backward=opt_in, cost=cost)
            if outcome.peak_bytes < best[1].peak_bytes:
                best = (dict(actions), outcome)
        return best[0], opt_in, best[1]
    for fqn, action in steps:
        if outcome.peak_bytes <= budget_bytes:
            break
        actions[fqn] = action
        outcome = evaluate(profile, actions, optimizer_in_backward=opt_in, cost=cost)
    return actions, opt_in, outcome


def min_peak_bytes(profile: Profile, *, cost: CostModel | None = None) -> dict[str, int]:
    """The smallest predicted peak each strategy reaches (strategy -> bytes)."""
    cost = cost or CostModel()
    return {s: _search(profile, s, None, cost)[2].peak_bytes for s in STRATEGIES if s != "auto"}


def make_plan(
    profile: Profile,
    *,
    budget_bytes: int,
    strategy: str = "auto",
    bandwidth_bytes_per_s: float = 25e9,
    optimizer_in_backward: bool = False,
    cost: CostModel | None = None,
) -> Plan:
    """Plan keep / offload / recompute per unit so the predicted peak fits ``budget_bytes``.

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
    best_strategy = min(minima, key=lambda s: minima[s])
    if strategy == "auto":
        order = ["eager", "recompute", "offload", "offload+opt-in-backward"]
        if optimizer_in_backward:
            order = ["offload+opt-in-backward"]
        tried = [(s, *_search(profile, s, budget_bytes, cost)) for s in order]
        fits = [t for t in tried if t[3].peak_bytes <= budget_bytes]
        if fits:
            chosen = min(fits, key=lambda t: (t[2], t[3].extra_compute_s + t[3].exposed_s))
            _, actions, opt_in, outcome = chosen
        else:
            actions, opt_in, outcome = tried[-1][1], tried[-1][2], tried[-1][3]
    else:
        actions, opt_in, outcome = _search(profile, strategy, budget_bytes, cost)
        opt_in = opt_in or optimizer_in_backward
        if optimizer_in_backward and strategy != "offload+opt-in-backward":
            outcome = evaluate(profile, actions, optimizer_in_backward=True, cost=cost)
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
        units=tuple(UnitDecision(f, a, unit_bytes[f]) for f, a in actions.items()),
        strategy=strategy,
        budget_bytes=budget_bytes,
        optimizer_in_backward=opt_in,
        predicted_peak_bytes=outcome.peak_bytes,
        min_budget_bytes=minima[best_strategy],
        host_bytes=outcome.host_bytes,
        extra_compute_s=outcome.extra_compute_s,
        transfer_s=outcome.transfer_s,
        feasible=True,
        tensors=tensors,
    )
