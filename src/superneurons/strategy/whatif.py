"""What ``auto`` would choose at another world size, or on a link of another rate.

A decision (:func:`.select.select`) is a pure function of measured inputs: when each bucket is
ready in backward, how long backward computes, each candidate's per-byte costs and one-shot
error, the network's α-β lines, the rest of the step. :class:`DecisionInputs` keeps them
(JSON round trip: ``auto`` records them at its decision), and :func:`decide_at` selects again
on the network carried to ``world_size`` ranks (:meth:`~.netmodel.NetworkModel.at_world_size`)
and, optionally, to a link of ``link_bit_s``. What moves and what does not:

* the wire: each collective by its ring factor (bytes each rank moves, message steps);
* decodes: a gathered codec decodes one payload per rank, so its decode grows with P; a
  two-phase exchange decodes every owner's slice once, whatever P is (:mod:`.cost`);
* compute (backward, encodes) and the rest of the step stay as measured: one rank's work
  does not depend on how many ranks there are;
* a link rate scales every per-byte time by the ratio of rates and keeps the latencies. The
  fitted per-byte times include gloo's own copies and sums on the CPU, which a faster link
  does not speed up, so at 10-100 Gbit/s the wire part is a lower bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from superneurons.errors import ConfigError
from superneurons.strategy.codecs import CodecCost
from superneurons.strategy.cost import BucketTiming
from superneurons.strategy.netmodel import LinkModel, NetworkModel
from superneurons.strategy.select import Assignment, route_of, select

__all__ = ["DecisionInputs", "decide_at", "implied_link_bit_s", "predicted_steps"]

DECISION_INPUTS_VERSION = 1
_COST_FIELDS = tuple(f.name for f in dataclasses.fields(CodecCost) if f.name != "codec")


@dataclass(frozen=True)
class DecisionInputs:
    """Everything one decision was made from (see the module docs)."""

    buckets: tuple[BucketTiming, ...]
    costs: tuple[CodecCost, ...]
    backward_s: float
    outside_s: float
    network: NetworkModel
    max_rel_error: float
    max_rel_error_lowrank: float | None = None
    link_bit_s: float | None = None  # the rate the network was fitted on, when known

    def decide(self) -> Assignment:
        """The selection these inputs give (what ``auto`` decided)."""
        return select(
            self.buckets,
            self.costs,
            backward_s=self.backward_s,
            network=self.network,
            max_rel_error=self.max_rel_error,
            max_rel_error_lowrank=self.max_rel_error_lowrank,
            outside_s=self.outside_s,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": DECISION_INPUTS_VERSION,
            "buckets": [dataclasses.asdict(b) for b in self.buckets],
            "costs": [
                {"codec": c.spec, **{k: getattr(c, k) for k in _COST_FIELDS}} for c in self.costs
            ],
            "backward_s": self.backward_s,
            "outside_s": self.outside_s,
            "network": self.network.to_dict(),
            "max_rel_error": self.max_rel_error,
            "max_rel_error_lowrank": self.max_rel_error_lowrank,
            "link_bit_s": self.link_bit_s,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DecisionInputs:
        if d.get("version") != DECISION_INPUTS_VERSION:
            raise ConfigError(f"decision inputs version {d.get('version')!r} is not supported")
        try:
            costs = tuple(
                CodecCost(codec=route_of(c["codec"]), **{k: c[k] for k in _COST_FIELDS})
                for c in d["costs"]
            )
            buckets = tuple(
                BucketTiming(b["key"], tuple(b["params"]), int(b["numel"]), float(b["ready_s"]))
                for b in d["buckets"]
            )
            return cls(
                buckets=buckets,
                costs=costs,
                backward_s=float(d["backward_s"]),
                outside_s=float(d["outside_s"]),
                network=NetworkModel.from_dict(d["network"]),
                max_rel_error=float(d["max_rel_error"]),
                max_rel_error_lowrank=d.get("max_rel_error_lowrank"),
                link_bit_s=d.get("link_bit_s"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed decision inputs: {exc}") from None


def implied_link_bit_s(network: NetworkModel) -> float:
    """The link rate the all-gather line implies: each rank receives ``(P - 1)`` times what it
    sends, so one link's per-byte time is ``β_allgather / (P - 1)``."""
    if network.world_size < 2 or network.all_gather.beta_s_per_byte <= 0:
        raise ConfigError("no link rate: the network was fitted on one rank or has no slope")
    return 8.0 * (network.world_size - 1) / network.all_gather.beta_s_per_byte


def _at_rate(network: NetworkModel, ratio: float) -> NetworkModel:
    """Every per-byte time times ``ratio`` (a slower link: > 1), latencies kept."""

    def scaled(link: LinkModel) -> LinkModel:
        return LinkModel(link.alpha_s, link.beta_s_per_byte * ratio)

    return NetworkModel(
        network.world_size,
        scaled(network.all_reduce),
        scaled(network.all_gather),
        scaled(network.alltoall),
    )


def decide_at(
    inputs: DecisionInputs,
    *,
    world_size: int | None = None,
    link_bit_s: float | None = None,
    network: NetworkModel | None = None,
    network_link_bit_s: float | None = None,
) -> Assignment:
    """The selection ``inputs`` give at ``world_size`` ranks on a link of ``link_bit_s``
    (None: as measured). ``network``: use this fit instead of the inputs' own (e.g. one made
    at a larger world size, on a link of ``network_link_bit_s``), carried the same way. The
    rate a fit was made at is the one given, else the one its all-gather line implies."""
    net = inputs.network if network is None else network
    fitted_bit_s = inputs.link_bit_s if network is None else network_link_bit_s
    if world_size is not None:
        net = net.at_world_size(world_size)
    if link_bit_s is not None:
        if not link_bit_s > 0:
            raise ConfigError(f"link_bit_s must be > 0, got {link_bit_s}")
        fitted = fitted_bit_s or implied_link_bit_s(net)
        net = _at_rate(net, fitted / link_bit_s)
    return dataclasses.replace(inputs, network=net).decide()


def predicted_steps(
    inputs: DecisionInputs, specs: Sequence[str], **where: Any
) -> dict[str, float | None]:
    """Predicted whole training steps (``by_spec`` + the rest of the step) of the fixed choices
    ``specs`` (canonical specs; ``"dense"``) and of ``auto``'s own mix, under :func:`decide_at`."""
    assignment = decide_at(inputs, **where)
    out: dict[str, float | None] = {
        spec: (
            assignment.by_spec[spec] + assignment.outside_s if spec in assignment.by_spec else None
        )
        for spec in specs
    }
    out["auto"] = assignment.predicted_train_step_s
    return out
