"""The cost-aware planner: Profile + byte budget -> Plan (pure; no tensors are touched).

Rules (SuperNeurons, Wang et al., PPoPP'18 §3.2-3.3), then a greedy improvement:

* **offload** the saved activations of compute-heavy units (conv, matmul): their forward hides the
  copy to the host and the backward of the unit after them hides the prefetch (the runtime
  prefetches one unit ahead), so the exposed cost is ``max(0, copy_s - compute_s)``;
* **recompute** cheap units (BN, activations, pooling): cost is their forward time, from FLOPs and
  bytes written under a roofline (or measured, for real profiles);
* when the budget demands more, **recompute+offload**: the unit is recomputed *and* its checkpoint
  (the input the checkpoint saves) goes to the host pool, prefetched one unit ahead in backward,
  so nothing of the unit stays on the device between its forward and its backward; this is what
  brings the peak down to the largest unit's working set (``memory.bounds``);
* candidates are taken in ascending *cost per byte saved* (the DTR heuristic of Kirisame et al.,
  ICLR'21, applied offline) until the predicted peak fits the budget. The chosen plan is the shortest
  prefix that fits, so the predicted peak never rises when the budget falls.

The peak under a plan is predicted from the profile's measured live intervals: a storage saved only
by non-keep units is absent between the end of its units' forward and their backward (recompute)
or the prefetch one unit ahead (offload, recompute+offload); plain checkpoint inputs stay; recompute adds its transient
forward bytes at the unit's backward start. ``optimizer_in_backward`` frees each gradient as soon as
it is applied (``register_post_accumulate_grad_hook``), so the gradient row of the timeline and the
step phase drop to the largest single gradient. Strategy ``offload+opt-on-host`` may also keep the
optimizer state in the host pool (ZeRO-Offload's placement, Ren et al. ATC'21): on the device only
the state of the parameter being stepped and the one prefetched
(:func:`~superneurons.memory.optim_backward.host_state_timeline`), its copies timed by the device
preset beside backward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from superneurons.bytesize import format_bytes
from superneurons.errors import ConfigError
from superneurons.memory.bounds import largest_unit_bytes, resident_bytes
from superneurons.memory.cost import CostModel
from superneurons.memory.plan import (
    SEARCH_STRATEGIES,
    SINGLE_DEVICE_STRATEGIES,
    STRATEGIES,
    InfeasibleBudgetError,
    Plan,
    StrategyFloor,
    TensorDecision,
    UnitDecision,
)
from superneurons.memory.predict import Outcome, evaluate, segment_runs
from superneurons.memory.profile_types import Profile

__all__ = ["CostModel", "evaluate", "make_plan", "min_peak_bytes", "strategy_floors"]

logger = logging.getLogger("superneurons.memory")


def _candidates(
    profile: Profile, allowed: tuple[str, ...], cost: CostModel
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(fqn, action) steps in ascending cost per byte saved (recompute, or offload where compute
    hides the copy), then the upgrades to ``recompute+offload`` (offload-capable strategies) in
    ascending cost per checkpoint byte: the planner offloads beyond what compute hides only
    when the budget demands it."""
    steps: list[tuple[float, str, str]] = []
    upgrades: list[tuple[float, str, str]] = []
    seconds = cost.unit_seconds(profile)
    for unit in profile.units:
        if unit.saved_bytes == 0 or not allowed:
            continue
        compute_s = seconds[unit.fqn]
        copy_s, fetch_s = cost.copy_s(unit.saved_bytes), cost.fetch_s(unit.saved_bytes)
        options = {}
        if "recompute" in allowed and not unit.inplace:
            options["recompute"] = compute_s
        if "offload" in allowed:
            options["offload"] = max(0.0, copy_s - compute_s) + max(0.0, fetch_s - 2 * compute_s)
            options["offload"] += 1e-3 * copy_s  # NOTE: tie-break: host bandwidth is not free
        if not options:
            continue
        action = min(options, key=lambda a: options[a])
        steps.append((options[action] / unit.saved_bytes, unit.fqn, action))
        if "offload" in allowed and not unit.inplace and unit.input_bytes > 0:
            in_s = cost.copy_s(unit.input_bytes) + cost.fetch_s(unit.input_bytes)
            joint_s = compute_s + max(0.0, in_s - compute_s) + 1e-3 * in_s
            upgrades.append((joint_s / unit.input_bytes, unit.fqn, "recompute+offload"))
    return [(f, a) for _, f, a in sorted(steps)], [(f, a) for _, f, a in sorted(upgrades)]


_ALLOWED: dict[str, tuple[str, ...]] = {
    "eager": (),
    "recompute": ("recompute",),
    "offload": ("recompute", "offload"),
    "offload+opt-in-backward": ("recompute", "offload"),
    "offload+opt-on-host": ("recompute", "offload"),
}
_IN_BACKWARD = ("offload+opt-in-backward", "offload+opt-on-host")


_SEGMENT: tuple[str, str] = ("", "segment")  # the step that turns on memory-centric segments
_HOST_STATE: tuple[str, str] = ("", "optimizer-on-host")  # optimizer state to the host pool


@dataclass
class _Choice:
    strategy: str
    actions: dict[str, str]
    segments: dict[str, int]
    optimizer_in_backward: bool
    outcome: Outcome
    optimizer_on_host: bool = False


def _search(profile: Profile, strategy: str, budget_bytes: int | None, cost: CostModel) -> _Choice:
    """Shortest candidate prefix that fits ``budget_bytes`` (None: the prefix with least peak)."""
    opt_in = strategy in _IN_BACKWARD
    if strategy == "checkpoint":
        actions = {u.fqn: "keep" if u.inplace else "recompute" for u in profile.units}
        return _Choice(strategy, actions, {}, False, evaluate(profile, actions, cost=cost))
    actions = {u.fqn: "keep" for u in profile.units}
    first, upgrades = _candidates(profile, _ALLOWED[strategy], cost)
    segment: list[tuple[str, str]] = [_SEGMENT] if "recompute" in _ALLOWED[strategy] else []
    # NOTE: with a host pool, checkpoints go to the host (hidden behind recompute) before
    # memory-centric segments, which recompute twice and still hold the segment inputs
    # NOTE: optimizer state to the host first: its copies run on the pool's streams beside the
    # whole backward (exposed only beyond it), the cheapest bytes per second there are
    host = [_HOST_STATE] if strategy == "offload+opt-on-host" else []
    steps = host + first + upgrades + segment
    segmented = on_host = False

    def outcome_of() -> Outcome:
        segments = segment_runs(profile, actions) if segmented else {}
        return evaluate(
            profile,
            actions,
            optimizer_in_backward=opt_in,
            cost=cost,
            segments=segments,
            optimizer_on_host=on_host,
        )

    def choice(outcome: Outcome) -> _Choice:
        segments = segment_runs(profile, actions) if segmented else {}
        return _Choice(strategy, dict(actions), segments, opt_in, outcome, on_host)

    outcome = outcome_of()
    best = choice(outcome)
    for fqn, action in steps:
        if budget_bytes is not None and outcome.peak_bytes <= budget_bytes:
            return choice(outcome)
        if (fqn, action) == _SEGMENT:
            segmented = True
        elif (fqn, action) == _HOST_STATE:
            on_host = True
        else:
            actions[fqn] = action
        outcome = outcome_of()
        if outcome.peak_bytes < best.outcome.peak_bytes:
            best = choice(outcome)
    return best if budget_bytes is None else choice(outcome)


_FLOORS: list[tuple[Profile, str, CostModel, _Choice]] = []  # the last few floor searches


def _floor(profile: Profile, strategy: str, cost: CostModel) -> _Choice:
    """``_search(profile, strategy, None, cost)``, remembered for the last few profiles: ``plan``
    asks for every strategy's floor, then ``make_plan`` does again (an 8B-parameter step: 250
    evaluations of a 28,000-event timeline each time)."""
    for seen, name, model, choice in _FLOORS:
        if seen is profile and name == strategy and model == cost:
            return choice
    choice = _search(profile, strategy, None, cost)
    _FLOORS.append((profile, strategy, cost, choice))
    del _FLOORS[: -2 * len(STRATEGIES)]
    return choice


def min_peak_bytes(profile: Profile, *, cost: CostModel | None = None) -> dict[str, int]:
    """The smallest predicted peak each strategy reaches (strategy -> bytes)."""
    cost = cost or CostModel()
    return {s: _floor(profile, s, cost).outcome.peak_bytes for s in SEARCH_STRATEGIES}


def strategy_floors(
    profile: Profile,
    *,
    cost: CostModel | None = None,
    strategies: tuple[str, ...] = SEARCH_STRATEGIES,
) -> dict[str, StrategyFloor]:
    """Each strategy's smallest predicted peak, where it is and what it holds (``plan --json``
    ``strategies``): the plan each strategy reaches with no budget, evaluated once."""
    cost = cost or CostModel()
    eager = profile.predicted_peak_bytes()
    largest = largest_unit_bytes(profile)
    floors = {}
    for strategy in strategies:
        best = _floor(profile, strategy, cost)
        outcome = best.outcome
        resident = profile.param_bytes
        resident += 0 if best.optimizer_in_backward else profile.grad_bytes
        resident += 0 if best.optimizer_on_host else profile.optimizer_state_bytes
        floors[strategy] = StrategyFloor(
            strategy=strategy,
            min_budget_bytes=outcome.peak_bytes,
            eager_peak_bytes=eager,
            resident_bytes=resident,
            largest_unit_bytes=largest,
            host_bytes=outcome.host_bytes,
            predicted_overhead_s=outcome.extra_compute_s + outcome.exposed_s,
            peak_at=outcome.peak_at,
            breakdown=outcome.breakdown,
            supports_ddp=strategy not in SINGLE_DEVICE_STRATEGIES,
            optimizer_on_host=best.optimizer_on_host,
            optimizer_host_bytes=outcome.optimizer_host_bytes,
        )
    return floors


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
    ``offload+opt-in-backward`` (also step the optimizer in backward), ``offload+opt-on-host``
    (that, with the optimizer state in the host pool when the budget needs it:
    ``Plan.optimizer_on_host``), ``auto`` (the feasible plan with the least exposed time,
    optimizer-in-backward only if nothing else fits, or if ``optimizer_in_backward=True``, and
    the state on the host only if nothing on the device fits).

    Raises:
        InfeasibleBudgetError: no plan of ``strategy`` fits; the message names the minimum budget
            and the strategy that reaches it.
        ConfigError: bad strategy or budget.
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ConfigError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    if cost is None and min(profile.copy_bytes_per_s) > 0:
        d2h, h2d = profile.copy_bytes_per_s  # measured with a real CUDA profile
        cost = replace(CostModel(), bandwidth_bytes_per_s=d2h, h2d_bytes_per_s=h2d, name="measured")
    if cost is None:
        cost = CostModel(bandwidth_bytes_per_s=bandwidth_bytes_per_s)
    minima = min_peak_bytes(profile, cost=cost)
    if not allow_optimizer_in_backward:
        if optimizer_in_backward or strategy in _IN_BACKWARD:
            raise ConfigError("optimizer_in_backward contradicts allow_optimizer_in_backward=False")
        for name in _IN_BACKWARD:
            minima.pop(name, None)
    best_strategy = min(minima, key=lambda s: minima[s])
    if strategy == "auto":
        order = ["eager", "recompute", "offload", *_IN_BACKWARD]
        if not allow_optimizer_in_backward:
            order = order[: -len(_IN_BACKWARD)]
        if optimizer_in_backward:
            order = list(_IN_BACKWARD)
        tried = [_search(profile, s, budget_bytes, cost) for s in order]
        fits = [c for c in tried if c.outcome.peak_bytes <= budget_bytes]
        chosen = (
            min(
                fits,
                key=lambda c: (
                    c.optimizer_in_backward,
                    c.optimizer_on_host,
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
        strategy=chosen.strategy,
        budget_bytes=budget_bytes,
        optimizer_in_backward=chosen.optimizer_in_backward,
        predicted_peak_bytes=outcome.peak_bytes,
        min_budget_bytes=minima[best_strategy],
        host_bytes=outcome.host_bytes,
        extra_compute_s=outcome.extra_compute_s,
        transfer_s=outcome.transfer_s,
        feasible=True,
        tensors=tensors,
        resident_bytes=resident_bytes(profile),
        largest_unit_bytes=largest_unit_bytes(profile),
        optimizer_on_host=chosen.optimizer_on_host,
        optimizer_host_bytes=outcome.optimizer_host_bytes,
        optimizer_copy_s=outcome.optimizer_copy_s,
        peak_at=outcome.peak_at,
        breakdown=outcome.breakdown,
    )
