"""Per-bucket codec selection: the least predicted step time within an error budget.

One monolithic method is wrong for most models (Poseidon, Zhang et al. ATC'17, picks per
layer between sufficient-factor broadcast and a parameter server by their byte counts;
Parallax, Kim et al. EuroSys'19, sends sparse variables sparsely and dense ones by
all-reduce). Espresso (Wang et al., EuroSys'23) makes the choice per tensor from a timeline
of when gradients are ready and measured codec costs, and finds a greedy search within a few
percent of the optimum. :func:`select` does the same over the buckets of a DDP model:

1. start from dense everywhere (so the answer never predicts slower than dense);
2. visit buckets from the last ready to the first (the last one's communication is the
   least hidden, so it is worth compressing first), and give each the candidate that
   lowers the predicted step time most; repeat the sweep until nothing changes;
3. a change must gain at least ``min_gain`` of the current prediction (the model's own
   error is a few percent: a smaller gain is noise, and dense is exact).

Candidates whose one-shot relative error exceeds ``max_rel_error`` are never chosen; low-rank
candidates (PowerSGD) are held to ``max_rel_error_lowrank`` instead when it is given. Why two
budgets: under error feedback with warm start, what PowerSGD drops is the spectrum's tail,
which the residual resends and the warm-started power iteration tracks (Vogels et al.,
NeurIPS'19), while a sparsifier drops different coordinates every step; measured on the
benchmark ResNet (``benchmarks/results/network/auto/error_budget.json``), PowerSGD rank 4 at a
one-shot error of 0.74 ended closer to dense than top-k 10% at 0.68, so one threshold on the
one-shot error cannot admit the first and exclude the second.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from superneurons.codecs.codec import Codec
from superneurons.codecs.powersgd import PowerSGD
from superneurons.codecs.twophase import TwoPhase
from superneurons.errors import ConfigError
from superneurons.schemes.grammar import parse_spec
from superneurons.strategy.codecs import DENSE, Candidate, CodecCost
from superneurons.strategy.cost import BucketTiming, predicted_step_s
from superneurons.strategy.netmodel import NetworkModel

__all__ = ["ASSIGNMENT_VERSION", "Assignment", "select"]

ASSIGNMENT_VERSION = 1
_MAX_SWEEPS = 8  # each sweep can only lower the prediction; 2-3 suffice in practice


@dataclass(frozen=True)
class Assignment:
    """The decision the hook carries out: a codec per bucket and per parameter.

    None means dense, the plain fp32 all-reduce. Round-trips through :meth:`to_json`, which
    writes each codec's spec (``"dense"`` for None).
    """

    version: int
    choices: Mapping[str, Candidate | None]
    params: Mapping[str, Candidate | None]
    predicted_step_s: float
    reason: str
    # predicted step time of dense everywhere, for the log and drift checks
    dense_step_s: float = field(default=0.0)
    # measured seconds of each step outside backward and its communication (the forward pass,
    # the optimizer, the data): ``predicted_step_s`` counts from backward's start, so a step
    # as a training loop times it is predicted as ``predicted_step_s + outside_s``
    outside_s: float = field(default=0.0)
    # predicted step time (from backward's start) with each measured candidate on every bucket,
    # budget or not: what the model says of each fixed choice, to hold against measurements
    by_spec: Mapping[str, float] = field(default_factory=dict)
    # each measured candidate's one-shot relative error (what the budgets were held against)
    rel_errors: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.version != ASSIGNMENT_VERSION:
            raise ConfigError(
                f"Assignment version {self.version!r} is not supported (expected "
                f"{ASSIGNMENT_VERSION}); decide again with this version"
            )
        object.__setattr__(self, "choices", MappingProxyType(dict(self.choices)))
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        object.__setattr__(self, "by_spec", MappingProxyType(dict(self.by_spec)))
        object.__setattr__(self, "rel_errors", MappingProxyType(dict(self.rel_errors)))
        if not self.outside_s >= 0.0:
            raise ConfigError(f"Assignment.outside_s must be >= 0, got {self.outside_s}")

    @property
    def predicted_train_step_s(self) -> float:
        """The whole training step as a loop times it: the prediction plus ``outside_s``."""
        return self.predicted_step_s + self.outside_s

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "choices": {key: _spec(route) for key, route in self.choices.items()},
            "params": {name: _spec(route) for name, route in self.params.items()},
            "predicted_step_s": self.predicted_step_s,
            "dense_step_s": self.dense_step_s,
            "outside_s": self.outside_s,
            "predicted_train_step_s": self.predicted_train_step_s,
            "by_spec": dict(self.by_spec),
            "rel_errors": dict(self.rel_errors),
            "reason": self.reason,
        }

    @classmethod
    def from_json(cls, s: str) -> Assignment:
        try:
            d = json.loads(s)
            routes: dict[str, Candidate | None] = {}  # each distinct spec parsed once
            for spec in {*d["choices"].values(), *d["params"].values()}:
                routes[str(spec)] = route_of(str(spec))
            return cls(
                version=int(d["version"]),
                choices={str(k): routes[str(v)] for k, v in d["choices"].items()},
                params={str(k): routes[str(v)] for k, v in d["params"].items()},
                predicted_step_s=float(d["predicted_step_s"]),
                reason=str(d["reason"]),
                dense_step_s=float(d.get("dense_step_s", 0.0)),
                outside_s=float(d.get("outside_s", 0.0)),
                by_spec={str(k): float(v) for k, v in d.get("by_spec", {}).items()},
                rel_errors={str(k): float(v) for k, v in d.get("rel_errors", {}).items()},
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"malformed Assignment JSON: {exc}") from None


def _spec(route: Candidate | None) -> str:
    return "dense" if route is None else route.spec


def route_of(spec: str) -> Candidate | None:
    """A spec of :meth:`Assignment.to_json` back to its codec (None: dense)."""
    if spec == "dense":
        return None
    parsed = parse_spec(spec)
    if not isinstance(parsed, Codec | PowerSGD | TwoPhase):
        raise ConfigError(f"the assignment names {spec!r}, not a codec")
    return parsed


def _describe(chosen: Mapping[str, CodecCost], buckets: Sequence[BucketTiming]) -> str:
    counts: dict[str, int] = {}
    for bucket in buckets:
        spec = chosen[bucket.key].spec
        counts[spec] = counts.get(spec, 0) + 1
    return ", ".join(f"{n}x {spec}" for spec, n in sorted(counts.items()))


def select(
    buckets: Sequence[BucketTiming],
    costs: Sequence[CodecCost],
    *,
    backward_s: float,
    network: NetworkModel,
    max_rel_error: float = 0.6,
    max_rel_error_lowrank: float | None = None,
    min_gain: float = 0.02,
    outside_s: float = 0.0,
) -> Assignment:
    """Choose a codec per bucket (see the module docstring); pure and deterministic.

    Args:
        buckets: the measured buckets (keys must be unique).
        costs: the measured candidates; dense (:data:`DENSE`) is added when missing.
        backward_s: seconds of backward compute (measured with dense).
        network: the fitted network model.
        max_rel_error: candidates above this one-shot relative error are excluded.
        max_rel_error_lowrank: the same for PowerSGD candidates (None: ``max_rel_error``).
        min_gain: a change must lower the prediction by this fraction.
        outside_s: measured seconds per step outside backward and its communication; it
            does not enter the choice (the same for every candidate), only the record.

    Raises:
        ConfigError: no buckets, duplicate bucket keys, or a negative budget.
    """
    if not buckets:
        raise ConfigError("select needs at least one bucket")
    keys = [b.key for b in buckets]
    if len(set(keys)) != len(keys):
        raise ConfigError("bucket keys must be unique (use strategy.bucket_key(params))")
    lowrank_budget = max_rel_error if max_rel_error_lowrank is None else max_rel_error_lowrank
    if max_rel_error < 0 or lowrank_budget < 0 or not 0 <= min_gain < 1:
        raise ConfigError("max_rel_error(_lowrank) >= 0 and min_gain in [0, 1)")
    if not outside_s >= 0.0:
        raise ConfigError(f"outside_s must be >= 0, got {outside_s}")
    dense = next((c for c in costs if c.codec is None), DENSE)

    def within_budget(cost: CodecCost) -> bool:
        return cost.rel_error <= (lowrank_budget if cost.low_rank else max_rel_error)

    allowed = [dense] + [c for c in costs if c.codec is not None and within_budget(c)]
    chosen: dict[str, CodecCost] = {key: dense for key in keys}

    def predict(choice: Mapping[str, CodecCost]) -> float:
        return predicted_step_s(buckets, choice, backward_s=backward_s, network=network)

    dense_s = current_s = predict(chosen)
    order = sorted(buckets, key=lambda b: (b.ready_s, b.key), reverse=True)  # last ready first
    for _ in range(_MAX_SWEEPS):
        changed = False
        for bucket in order:
            best, best_s = chosen[bucket.key], current_s
            for candidate in allowed:
                if candidate.codec == chosen[bucket.key].codec:
                    continue
                trial_s = predict({**chosen, bucket.key: candidate})
                # NOTE: ties go to the smaller error, so a hidden bucket stays dense.
                if trial_s < best_s - min_gain * current_s or (
                    trial_s <= best_s and candidate.rel_error < best.rel_error
                ):
                    best, best_s = candidate, trial_s
            if best is not chosen[bucket.key]:
                chosen[bucket.key], current_s, changed = best, best_s, True
        if not changed:
            break
    by_spec = {c.spec: predict(dict.fromkeys(keys, c)) for c in [dense, *costs]}
    summary = _describe(chosen, buckets)
    if all(c.codec is None for c in chosen.values()):
        reason = f"dense: no candidate gains {min_gain:.0%} (pred {dense_s:.4g} s)"
    else:
        reason = f"{summary}: pred {current_s:.4g} s vs dense {dense_s:.4g} s"
    reason += f" (+{outside_s:.3g} s outside backward)"
    return Assignment(
        version=ASSIGNMENT_VERSION,
        choices={b.key: chosen[b.key].codec for b in buckets},
        params={name: chosen[b.key].codec for b in buckets for name in b.params},
        predicted_step_s=current_s,
        reason=reason,
        dense_step_s=dense_s,
        outside_s=outside_s,
        by_spec=by_spec,
        rel_errors={c.spec: c.rel_error for c in [dense, *costs]},
    )
