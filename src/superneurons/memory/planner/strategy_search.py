"""The planner's search: per strategy, the shortest prefix of candidate actions that fits.

Candidates are taken in ascending cost per byte saved (module docstring of
:mod:`superneurons.memory.planner.decide`, which turns a search's choice into a :class:`Plan`); each
strategy searches the plain profile and then the profiles below the largest layer
(``chunked``); :func:`~superneurons.memory.planner.decide.search_floors` runs it for every
strategy with no budget (the floors).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from superneurons.errors import ConfigError
from superneurons.memory.plan import TrainingStep
from superneurons.memory.planner.buckets import BUCKET_CAPS, assign_buckets
from superneurons.memory.planner.cost import CostModel
from superneurons.memory.planner.predict import Outcome, evaluate
from superneurons.memory.planner.weights import stream_order
from superneurons.memory.profile_types import Profile, UnitProfile

__all__ = [
    "HOST_OPTIMIZER",
    "IN_BACKWARD",
    "STREAM_WEIGHTS",
    "Choice",
    "search_all",
    "segment_runs",
    "usable",
]


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
        if "recompute" in allowed and _recomputable(profile, unit):
            options["recompute"] = compute_s
        if "offload" in allowed:
            options["offload"] = max(0.0, copy_s - compute_s) + max(0.0, fetch_s - 2 * compute_s)
            options["offload"] += 1e-3 * copy_s  # NOTE: tie-break: host bandwidth is not free
        if not options:
            continue
        action = min(options, key=lambda a: options[a])
        steps.append((options[action] / unit.saved_bytes, unit.fqn, action))
        if "offload" in allowed and _recomputable(profile, unit) and unit.input_bytes > 0:
            in_s = cost.copy_s(unit.input_bytes) + cost.fetch_s(unit.input_bytes)
            joint_s = compute_s + max(0.0, in_s - compute_s) + 1e-3 * in_s
            upgrades.append((joint_s / unit.input_bytes, unit.fqn, "recompute+offload"))
    return [(f, a) for _, f, a in sorted(steps)], [(f, a) for _, f, a in sorted(upgrades)]


def _recomputable(profile: Profile, unit: UnitProfile) -> bool:
    """Not an in-place unit, nor the chunked LM head (its loss is computed from labels that
    only the model's call in flight holds: it cannot be replayed in backward)."""
    return not unit.inplace and (profile.head is None or unit.fqn != profile.head.fqn)


_ALLOWED: dict[str, tuple[str, ...]] = {
    "eager": (),
    "recompute": ("recompute",),
    "offload": ("recompute", "offload"),
    "offload+opt-in-backward": ("recompute", "offload"),
    "offload+opt-on-host": ("recompute", "offload"),
    "offload+host-optimizer": ("recompute", "offload"),
    "stream-weights": ("recompute", "offload"),
}
IN_BACKWARD = ("offload+opt-in-backward", "offload+opt-on-host")
HOST_OPTIMIZER = "offload+host-optimizer"
# the host optimizer's search, then units' weights to the host pool, the cheapest copies first,
# only while the budget needs them (memory.planner.weights)
STREAM_WEIGHTS = "stream-weights"


_SEGMENT: tuple[str, str] = ("", "segment")  # the step that turns on memory-centric segments
_HOST_STATE: tuple[str, str] = ("", "optimizer-on-host")  # optimizer state to the host pool
_WEIGHTS = "weights"  # (fqn, _WEIGHTS): the unit's weights to the host pool


@dataclass
class Choice:
    """One strategy's search: the actions it took, the segments, where the optimizer steps,
    the predicted outcome and the profile it used."""

    strategy: str
    actions: dict[str, str]
    segments: dict[str, int]
    optimizer_in_backward: bool
    outcome: Outcome
    optimizer_on_host: bool = False
    profile: Profile | None = None
    buckets: tuple[tuple[str, ...], ...] = ()
    weights: tuple[str, ...] = ()  # the units whose weights stream from the host

    @property
    def host_optimizer(self) -> bool:
        return bool(self.buckets) or self.strategy in (HOST_OPTIMIZER, STREAM_WEIGHTS)


def search_all(
    profiles: Sequence[Profile],
    strategy: str,
    budget_bytes: int | None,
    cost: CostModel,
    step: TrainingStep | None = None,
) -> Choice:
    """The first profile whose search fits ``budget_bytes`` (None: the least peak over all),
    for a loop that clips or accumulates as ``step`` says (None: neither)."""
    tried = []
    runnable = usable(profiles, strategy)
    if not runnable:
        raise ConfigError(
            f"strategy {strategy!r} steps the optimizer in backward, which a head computing its "
            "gradient in the forward cannot follow: plan it with a recompute head as well"
        )
    for profile in runnable:
        choice = _search(profile, strategy, budget_bytes, cost, step)
        if choice.host_optimizer:
            choice = _widest_buckets(choice, budget_bytes, cost, step)
        if budget_bytes is not None and choice.outcome.peak_bytes <= budget_bytes:
            return choice
        tried.append(choice)
    return min(tried, key=lambda c: c.outcome.peak_bytes)  # first of equals: the plain one


def usable(profiles: Sequence[Profile], strategy: str) -> list[Profile]:
    """The profiles ``strategy`` can run."""
    # NOTE: a head computing its gradient in the forward holds its weight's gradient from
    # forward to backward, which stepping in backward exists to avoid, and the state timeline
    # (by gradient births) would fetch its state in the forward: not combined
    in_backward = strategy in IN_BACKWARD
    # NOTE: a head in vocabulary slices serves a streamed head (one slice on the device, its
    # gradient on the host); with the weight resident it only trades the token chunks' logits
    # for a slice's, at gradients no longer bit for bit the unchunked loss's: streaming only
    sliced = strategy != STREAM_WEIGHTS
    return [
        p
        for p in profiles
        if not (in_backward and p.head and p.head.mode != "recompute")
        and not (sliced and p.head and p.head.vocab_rows)
    ]


def _search(
    profile: Profile,
    strategy: str,
    budget_bytes: int | None,
    cost: CostModel,
    step: TrainingStep | None = None,
) -> Choice:
    """Shortest candidate prefix that fits ``budget_bytes`` (None: the prefix with least peak)."""
    opt_in = strategy in IN_BACKWARD
    host_opt = strategy in (HOST_OPTIMIZER, STREAM_WEIGHTS)
    buckets: tuple[tuple[str, ...], ...] = ()
    if host_opt:  # the search runs with the smallest buckets; _widest_buckets widens them
        events = profile.gradients
        buckets = assign_buckets(events, profile.grad_params, cap_bytes=BUCKET_CAPS[0])
    if strategy == "checkpoint":
        actions = {
            u.fqn: "recompute" if _recomputable(profile, u) else "keep" for u in profile.units
        }
        outcome = evaluate(profile, actions, cost=cost, step=step)
        return Choice(strategy, actions, {}, False, outcome, profile=profile)
    actions = {u.fqn: "keep" for u in profile.units}
    first, upgrades = _candidates(profile, _ALLOWED[strategy], cost)
    segment: list[tuple[str, str]] = [_SEGMENT] if "recompute" in _ALLOWED[strategy] else []
    weights: list[tuple[str, str]] = []
    if strategy == STREAM_WEIGHTS:
        # NOTE: a segment's first unit runs its members' forwards itself, past the hooks that
        # fetch their weights: no segments here; weights stream last, when nothing else fits
        segment = []
        weights = [(fqn, _WEIGHTS) for fqn in stream_order(profile, cost)]
    # NOTE: with a host pool, checkpoints go to the host (hidden behind recompute) before
    # memory-centric segments, which recompute twice and still hold the segment inputs
    # NOTE: optimizer state to the host first: its copies run on the pool's streams beside the
    # whole backward (exposed only beyond it), the cheapest bytes per second there are
    host = [_HOST_STATE] if strategy == "offload+opt-on-host" else []
    steps = host + first + upgrades + segment + weights
    segmented = on_host = False
    streamed: list[str] = []

    def outcome_of() -> Outcome:
        segments = segment_runs(profile, actions) if segmented else {}
        return evaluate(
            profile,
            actions,
            optimizer_in_backward=opt_in,
            cost=cost,
            segments=segments,
            optimizer_on_host=on_host,
            host_optimizer=host_opt,
            buckets=buckets if host_opt else None,
            streamed=frozenset(streamed),
            step=step,
        )

    def choice(outcome: Outcome) -> Choice:
        segments = segment_runs(profile, actions) if segmented else {}
        return Choice(
            strategy, dict(actions), segments, opt_in, outcome, on_host, profile, buckets,
            tuple(streamed),
        )  # fmt: skip

    outcome = outcome_of()
    best = choice(outcome)
    taken: list[str] = []  # units the prefix moved off "keep", in order
    for fqn, action in steps:
        if budget_bytes is not None and outcome.peak_bytes <= budget_bytes:
            break
        if (fqn, action) == _SEGMENT:
            segmented = True
        elif (fqn, action) == _HOST_STATE:
            on_host = True
        elif action == _WEIGHTS:
            streamed.append(fqn)
        else:
            if actions[fqn] == "keep":
                taken.append(fqn)
            actions[fqn] = action
        outcome = outcome_of()
        if outcome.peak_bytes < best.outcome.peak_bytes:
            best = choice(outcome)
    if budget_bytes is None:
        return best
    # NOTE: a unit whose cost per byte sits near another's can enter the prefix before the ones
    # the budget needs and end up lowering nothing (the peak moved elsewhere): every taken unit
    # is tried back to "keep", last first, and stays there where the plan still fits, so no unit
    # pays for time the budget does not need, and timing noise that reorders such a unit does
    # not change the plan
    fits = outcome.peak_bytes <= budget_bytes  # a trial replaces the outcome only if it fits
    for fqn in reversed(taken) if fits else ():
        action, actions[fqn] = actions[fqn], "keep"
        trial = outcome_of()
        if trial.peak_bytes <= budget_bytes:
            outcome = trial
        else:
            actions[fqn] = action
    return choice(outcome)


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


def _widest_buckets(
    choice: Choice, budget_bytes: int | None, cost: CostModel, step: TrainingStep | None = None
) -> Choice:
    """The host optimizer's buckets as wide as the budget allows (fewer, larger collectives):
    the largest of :data:`BUCKET_CAPS` whose peak fits ``budget_bytes`` (None: whose peak is
    the least), the actions kept."""
    profile = choice.profile
    assert profile is not None
    events = profile.gradients
    best = choice
    for cap in BUCKET_CAPS[1:]:
        buckets = assign_buckets(events, profile.grad_params, cap_bytes=cap)
        outcome = evaluate(
            profile,
            choice.actions,
            cost=cost,
            segments=choice.segments,
            host_optimizer=True,
            buckets=buckets,
            streamed=frozenset(choice.weights),
            step=step,
        )
        limit = best.outcome.peak_bytes if budget_bytes is None else budget_bytes
        if outcome.peak_bytes <= limit:
            best = replace(choice, outcome=outcome, buckets=buckets)
    return best
