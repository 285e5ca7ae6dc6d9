"""Rounds: each codec's timed steps split over several launches of the ranks, in alternating
codec order, and pooled into one record per codec.

Measured one after another, codecs see whatever the machine does meanwhile: on a shared VM the
same codec's CPU seconds per step moved by up to 20% between runs a minute apart, more than
some of the differences a benchmark is asked to rank. With ``rounds`` R the ranks are launched
R times per (link, model); round r runs the codecs forwards (r even) or backwards (r odd), so a
drift linear in time falls on every codec alike over each pair of rounds. A codec's record then
pools its R x ``steps`` timed steps (the means are over every timed step) and keeps each
round's own numbers under ``rounds``. Each round starts from fresh weights and its own warm-up,
as a single run does; ``auto`` decides afresh in each round (each decision is kept).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["order", "pool"]

# per-step quantities of a record: the pooled value is their mean over every timed step
_PER_STEP = (
    "mean_step_s",
    "cpu_step_s",
    "bytes_per_step",
    "bytes_received_per_rank",
    "bytes_received_max_rank",
    "bytes_sent_wire_per_rank",
)
# measured once per launch, before the codecs: the pooled value is their mean over rounds
_PER_LAUNCH = ("compute_step_s", "compute_cpu_s")
# kept for each round under "rounds"
_OWN = ("mean_step_s", "cpu_step_s", "compute_step_s", "sync_assignment")


def order(codecs: Sequence[str], round_index: int) -> tuple[str, ...]:
    """The codecs in round ``round_index``'s order: as given in even rounds, reversed in odd."""
    return tuple(codecs) if round_index % 2 == 0 else tuple(reversed(codecs))


def pool(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One record from one codec's per-round results (as the runner yields them, in round
    order). One round: that result, unchanged. A failed round fails the record: its error,
    the attempts of every round and how many rounds were ok."""
    if not results:
        raise ValueError("pool() needs at least one round's result")
    if len(results) == 1:
        return dict(results[0])
    attempts = sum(int(r.get("attempts", 1)) for r in results)
    failed = [r for r in results if r.get("status") != "ok"]
    if failed:
        ok = len(results) - len(failed)
        return {**failed[0], "attempts": attempts, "rounds_ok": ok, "rounds_run": len(results)}
    steps = [int(r["steps"]) for r in results]
    pooled = dict(results[0])
    for key in _PER_STEP:
        pooled[key] = _weighted(results, key, steps)
    for key in _PER_LAUNCH:
        pooled[key] = _weighted(results, key, [1] * len(results))
    pooled.update(
        steps=sum(steps),
        step_s_each=[s for r in results for s in r.get("step_s_each", [])],
        cpu_step_s_each=[s for r in results for s in r.get("cpu_step_s_each", [])],
        last_loss=results[-1].get("last_loss"),
        attempts=attempts,
        rounds=[{key: r[key] for key in _OWN if key in r} for r in results],
    )
    return pooled


def _weighted(results: Sequence[dict[str, Any]], key: str, weights: Sequence[int]) -> Any:
    """The weighted mean of ``key`` over the rounds; absent or None in any round (a loopback
    run measures no interface bytes): the first round's value, as a single run would say."""
    values = [r.get(key) for r in results]
    numbers = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    if len(numbers) < len(values):
        return results[0].get(key)
    return sum(w * v for w, v in zip(weights, numbers, strict=True)) / sum(weights)
