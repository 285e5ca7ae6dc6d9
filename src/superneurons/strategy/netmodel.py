"""The network as two α-β lines: how long one all-reduce / all-gather of ``nbytes`` takes.

Hockney's model (R. W. Hockney, "The communication challenge for MPP: Intel Paragon and Meiko
CS-2", Parallel Computing 20, 1994): one message of ``n`` bytes costs ``T(n) = α + β·n``, a
fixed latency plus a per-byte time. Collectives keep that form per call for a fixed world
size P (Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in
MPICH", IJHPCA 2005): a ring all-reduce of ``S`` bytes per rank moves ``2(P−1)/P·S`` bytes per
rank, an all-gather of ``S`` bytes per rank moves ``(P−1)·S``, an all-to-all of ``S`` bytes
per rank ``(P−1)/P·S``. So compression that must be all-gathered (its payloads differ in support
per rank) pays only when its ratio ``CR > P/2``, while a two-phase all-reduce (all-to-all, then
an all-gather of ``S/P``) moves ``2(P−1)/P·S`` like a ring.

We do not trust those constants: :func:`measure_network` times the collectives on the real
process group at a few sizes and :func:`fit_link` fits α and β by least squares. The same
factors carry a fit to another world size (:meth:`NetworkModel.at_world_size`): per-byte times
scale with the bytes each rank moves, latencies with the ``2(P−1)`` or ``P−1`` message steps
(ring all-reduce; all-gather and all-to-all), the same link under every rank (one switch
port each, as the benchmark's bridge gives them).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from superneurons.compat import all_gather_into_tensor
from superneurons.errors import ConfigError
from superneurons.strategy.timing import time_call_s

__all__ = [
    "LinkModel",
    "NetworkModel",
    "fit_link",
    "measure_network",
    "ring_network",
    "stated_network",
]

NETWORK_MODEL_VERSION = 2
# bytes each rank moves per input byte, and message steps, of each collective at P ranks
_BYTES_FACTOR = {
    "all_reduce": lambda p: 2.0 * (p - 1) / p,
    "all_gather": lambda p: float(p - 1),
    "all_to_all": lambda p: (p - 1) / p,
}
_STEPS_FACTOR = {
    "all_reduce": lambda p: 2.0 * (p - 1),
    "all_gather": lambda p: float(p - 1),
    "all_to_all": lambda p: float(p - 1),
}


@dataclass(frozen=True)
class LinkModel:
    """``T(nbytes) = alpha_s + beta_s_per_byte * nbytes`` (Hockney α-β), per collective call."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        for name in ("alpha_s", "beta_s_per_byte"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value >= 0.0 or value == float("inf"):
                raise ConfigError(f"LinkModel.{name} must be a finite number >= 0, got {value!r}")

    def time_s(self, nbytes: int) -> float:
        """Seconds one call with ``nbytes`` (per rank) takes; 0 bytes cost nothing (no call)."""
        if nbytes < 0:
            raise ConfigError(f"nbytes must be >= 0, got {nbytes}")
        return 0.0 if nbytes == 0 else self.alpha_s + self.beta_s_per_byte * nbytes


def _line(link: LinkModel) -> dict[str, float]:
    return {"alpha_s": link.alpha_s, "beta_s_per_byte": link.beta_s_per_byte}


@dataclass(frozen=True)
class NetworkModel:
    """The collectives the DDP hook issues, fitted on one process group of ``world_size``.

    ``all_reduce.time_s(n)``: one all-reduce of ``n`` bytes of input per rank;
    ``all_gather.time_s(n)``: one all-gather where every rank sends ``n`` bytes;
    ``alltoall.time_s(n)``: one all-to-all of ``n`` bytes of input per rank (``all_to_all`` as
    fitted, or None for a model fitted without it: then derived from the all-gather line,
    which moves ``P`` times the bytes per rank for the same input).
    """

    world_size: int
    all_reduce: LinkModel
    all_gather: LinkModel
    all_to_all: LinkModel | None = None

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise ConfigError(f"world_size must be an integer, got {self.world_size!r}")
        if self.world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {self.world_size}")

    @property
    def alltoall(self) -> LinkModel:
        """The all-to-all line: fitted, or the all-gather's per received byte."""
        if self.all_to_all is not None:
            return self.all_to_all
        gather = self.all_gather
        return LinkModel(gather.alpha_s, gather.beta_s_per_byte / self.world_size)

    def at_world_size(self, world_size: int) -> NetworkModel:
        """This network's lines carried to ``world_size`` ranks by the ring factors (module
        docs): per-byte times scale with the bytes each rank moves, latencies with the
        message steps. Needs a model fitted on at least 2 ranks."""
        if world_size == self.world_size:
            return self
        if self.world_size < 2 or world_size < 2:
            raise ConfigError(
                f"a network fitted on {self.world_size} rank(s) cannot be carried to "
                f"{world_size}: both need at least 2 ranks"
            )
        old, new = self.world_size, world_size

        def scaled(kind: str, link: LinkModel) -> LinkModel:
            steps, per_byte = _STEPS_FACTOR[kind], _BYTES_FACTOR[kind]
            return LinkModel(
                link.alpha_s * steps(new) / steps(old),
                link.beta_s_per_byte * per_byte(new) / per_byte(old),
            )

        return NetworkModel(
            world_size=new,
            all_reduce=scaled("all_reduce", self.all_reduce),
            all_gather=scaled("all_gather", self.all_gather),
            all_to_all=scaled("all_to_all", self.alltoall),
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "version": NETWORK_MODEL_VERSION,
            "world_size": self.world_size,
            "all_reduce": _line(self.all_reduce),
            "all_gather": _line(self.all_gather),
        }
        if self.all_to_all is not None:
            d["all_to_all"] = _line(self.all_to_all)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NetworkModel:
        """Reads this version and version 1 (no all-to-all line)."""
        version = d.get("version", NETWORK_MODEL_VERSION)
        if version not in (1, NETWORK_MODEL_VERSION):
            raise ConfigError(
                f"NetworkModel version {version!r} is not supported (expected "
                f"{NETWORK_MODEL_VERSION}); measure the network again"
            )
        try:
            alltoall = d.get("all_to_all")
            return cls(
                world_size=int(d["world_size"]),
                all_reduce=LinkModel(**d["all_reduce"]),
                all_gather=LinkModel(**d["all_gather"]),
                all_to_all=LinkModel(**alltoall) if alltoall is not None else None,
            )
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"malformed NetworkModel dict: {exc}") from None


def ring_network(world_size: int, *, alpha_s: float, bandwidth_bytes_per_s: float) -> NetworkModel:
    """The textbook ring model (Thakur et al. 2005) of a link of ``bandwidth_bytes_per_s``:
    all-reduce moves ``2(P−1)/P`` bytes per input byte, all-gather ``P−1`` per sent byte,
    all-to-all ``(P−1)/P`` per input byte; one latency ``alpha_s`` per call.
    For planning without measurements and for hand-checkable tests."""
    if bandwidth_bytes_per_s <= 0:
        raise ConfigError(f"bandwidth_bytes_per_s must be > 0, got {bandwidth_bytes_per_s}")
    p = world_size
    per_byte = 1.0 / bandwidth_bytes_per_s
    return NetworkModel(
        world_size=p,
        all_reduce=LinkModel(alpha_s, 2.0 * (p - 1) / p * per_byte),
        all_gather=LinkModel(alpha_s, (p - 1) * per_byte),
        all_to_all=LinkModel(alpha_s, (p - 1) / p * per_byte),
    )


def stated_network(world_size: int, *, rate_bit_s: float, latency_s: float) -> NetworkModel:
    """A link stated by its rate and its latency per message step, nothing measured: each
    collective at ``world_size`` ranks takes the ring factors (module docs) of the link's
    per-byte time — all-reduce ``2(P−1)/P``, all-gather ``P−1``, all-to-all ``(P−1)/P`` per
    input byte — and that many latencies as it has message steps: ``2(P−1)``, ``P−1``,
    ``P−1``. A pure function of the statement (``auto:link=RATE,latency=T``)."""
    if not rate_bit_s > 0 or rate_bit_s == float("inf"):
        raise ConfigError(f"a stated link's rate must be > 0 bit/s, got {rate_bit_s}")
    if not 0.0 <= latency_s < float("inf"):
        raise ConfigError(f"a stated link's latency must be >= 0 s, got {latency_s}")
    per_byte_s = 8.0 / rate_bit_s
    lines = {
        kind: LinkModel(
            _STEPS_FACTOR[kind](world_size) * latency_s,
            _BYTES_FACTOR[kind](world_size) * per_byte_s,
        )
        for kind in ("all_reduce", "all_gather", "all_to_all")
    }
    return NetworkModel(world_size=world_size, **lines)


def fit_link(sizes_bytes: Sequence[int], times_s: Sequence[float]) -> LinkModel:
    """Least-squares ``T = α + β·n`` through the points, with α, β ≥ 0.

    When the unconstrained fit gives a negative coefficient (noise on tiny sizes), the best
    fit with that coefficient at 0 is used instead (the constrained optimum lies on that edge).
    """
    if len(sizes_bytes) != len(times_s) or not sizes_bytes:
        raise ConfigError("fit_link needs as many times as sizes, at least one of each")
    xs = [float(x) for x in sizes_bytes]
    ys = [float(y) for y in times_s]
    if any(x < 0 for x in xs) or any(not y >= 0 for y in ys):
        raise ConfigError("fit_link: sizes and times must be >= 0")
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var_x = sum((x - mean_x) ** 2 for x in xs)
    if var_x == 0.0:  # one distinct size: no slope can be told from latency
        return LinkModel(0.0, mean_y / mean_x) if mean_x > 0 else LinkModel(mean_y, 0.0)
    beta = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var_x
    alpha = mean_y - beta * mean_x
    if beta < 0.0:
        return LinkModel(mean_y, 0.0)
    if alpha < 0.0:
        sxx = sum(x * x for x in xs)
        return LinkModel(0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sxx)
    return LinkModel(alpha, beta)


def _collective(
    kind: str, nbytes: int, world: int, device: torch.device, group: dist.ProcessGroup | None
) -> Callable[[], None]:
    """One blocking call of ``kind`` with ``nbytes`` of input per rank."""
    if kind == "all_reduce":
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)

        def all_reduce() -> None:
            dist.all_reduce(buf, group=group)

        return all_reduce
    if kind == "all_to_all":
        size = -(-nbytes // world) * world  # equal splits
        source = torch.ones(size, dtype=torch.uint8, device=device)
        target = torch.empty(size, dtype=torch.uint8, device=device)

        def all_to_all() -> None:
            dist.all_to_all_single(target, source, group=group)

        return all_to_all
    send = torch.ones(nbytes, dtype=torch.uint8, device=device)
    recv = torch.empty(nbytes * world, dtype=torch.uint8, device=device)

    def all_gather() -> None:
        all_gather_into_tensor(recv, send, group=group)

    return all_gather


def measure_network(
    group: dist.ProcessGroup | None = None,
    *,
    device: torch.device,
    sizes_bytes: Sequence[int] = (2**12, 2**18, 2**22),
    repeats: int = 3,
) -> NetworkModel:
    """Fit α-β lines for all-reduce, all-gather and all-to-all on ``group`` (collective: every
    rank calls it).

    Each size is run once to warm up, then ``repeats`` times; the median per size enters the
    fit. Every rank's medians are agreed by an all-reduce MAX (a collective ends when its
    slowest rank does), so every rank returns the same model.
    """
    if repeats < 1 or not sizes_bytes or any(s < 4 for s in sizes_bytes):
        raise ConfigError("measure_network: repeats >= 1 and every size >= 4 bytes")
    world = dist.get_world_size(group)
    medians: list[float] = []
    kinds = ("all_reduce", "all_gather", "all_to_all")
    for kind in kinds:
        for nbytes in sizes_bytes:
            call = _collective(kind, nbytes, world, device, group)
            call()  # warm-up: connection set-up and allocator growth are not the link
            medians.append(statistics.median(time_call_s(call, device) for _ in range(repeats)))
    agreed = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    times = [float(t) for t in agreed.cpu()]
    k = len(sizes_bytes)
    lines = {
        kind: fit_link(sizes_bytes, times[i * k : (i + 1) * k]) for i, kind in enumerate(kinds)
    }
    return NetworkModel(world_size=world, **lines)
