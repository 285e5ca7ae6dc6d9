"""``auto`` for Adam-family optimizers: dense AdamW, or 1-bit Adam when the cost model says it pays.

Why a separate decision: with AdamW the gradient codecs that ``auto`` chooses among for SGD
(:mod:`superneurons.ddp.autorun`) stall a language model (char-GPT: fft, top-k, sign
near 3.3 nats against dense's 2.46, ``benchmarks/results/convergence``). What converged within 0.05 nats at >= 8x fewer bytes is
optimizer-side: 1-bit Adam (Tang et al., ICML 2021; :class:`~superneurons.optim.adam.
CompressedAdamW` in mode ``momentum``) with a warm-up of 10% of the run on an fp16 wire. So
with Adam(W), ``auto`` chooses between exactly two schemes — dense AdamW (DDP's fp32
all-reduce) and :func:`one_bit_adam` — by the predicted step time:

* dense: DDP's buckets (``bucket_cap_mb``, filled in reverse parameter order) are all-reduced
  as backward produces them; a bucket is taken to be ready when backward has reached its last
  parameter, with backward's measured time spread over the parameters in proportion to their
  size (an assumption, stated: DDP's real ready times are not observed here);
* 1-bit Adam: the optimizer communicates in ``step()``, after backward: nothing overlaps.
  Warm-up steps all-reduce fp16 (measured fp16 encode/decode), the rest all-gather the
  scaled-sign momentum (measured encode/decode of ``signsgd``); the run's mean step counts
  both in proportion.

Both predictions are :func:`superneurons.strategy.cost.predicted_step_s` on the fitted
network model (:func:`superneurons.strategy.netmodel.measure_network`) plus each optimizer's
measured local ``step()`` (1-bit Adam's per-parameter encode, error feedback and decode are
Python loops that per-byte codec costs missed). 1-bit Adam is chosen only when its mean
predicted step is at least ``margin`` (20%) below dense's. Rank 0 decides and broadcasts, so
every rank builds the same optimizer.

``auto:link=100mbit`` plans for a *stated* link (the ring model of
:func:`~superneurons.strategy.netmodel.ring_network` at that rate, latency as measured) instead
of the measured one: for planning a deployment from a test machine, and labelled as such in
every record.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from superneurons.codecs.cast import Fp16Codec
from superneurons.codecs.sign import SignSGDCodec
from superneurons.errors import ConfigError
from superneurons.rates import format_rate
from superneurons.schemes.adam import AdamAuto, AdamMomentum, AdamScheme, AdamUpdate
from superneurons.schemes.grammar import parse_scheme

__all__ = [
    "AdamDecision",
    "OptimizerTimes",
    "decide_adam_scheme",
    "dense_bucket_timings",
    "one_bit_adam",
    "predict_adam_schemes",
    "warmup_steps_for",
]

logger = logging.getLogger("superneurons.compress.autoadam")

_DECISION_VERSION = 1


def warmup_steps_for(total_steps: int, config: AdamAuto) -> int:
    """1-bit Adam's warm-up for a run of ``total_steps``."""
    return max(config.min_warmup_steps, math.ceil(config.warmup_fraction * total_steps))


def one_bit_adam(warmup_steps: int) -> AdamMomentum:
    """The scheme that met the LM target at 3 seeds (benchmarks/results/convergence/README.md):
    ``adam-momentum[warmup=N,wire=fp16]:signsgd``."""
    return AdamMomentum(SignSGDCodec(), warmup_steps=warmup_steps, wire=Fp16Codec())


@dataclass(frozen=True)
class AdamDecision:
    """What ``auto`` chose for an Adam-family run, and the numbers it chose by."""

    scheme: AdamScheme | None  # None: dense AdamW (DDP's fp32 all-reduce); else 1-bit Adam
    warmup_steps: int
    predicted_dense_step_s: float
    predicted_compressed_step_s: float  # mean over the run, warm-up included
    backward_s: float
    link: str  # "measured" or "stated: 100mbit (ring model, not measured)"
    network: dict[str, Any]
    optimizer_s: dict[str, float] | None = None  # OptimizerTimes as a dict
    version: int = _DECISION_VERSION

    @property
    def compressed(self) -> bool:
        return self.scheme is not None

    @property
    def scheme_spec(self) -> str:
        """``"dense"`` or the 1-bit Adam spec (what runs record)."""
        return "dense" if self.scheme is None else str(self.scheme)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(replace(self, scheme=None)), "scheme": self.scheme_spec}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AdamDecision:
        if d.get("version") != _DECISION_VERSION:
            raise ConfigError(
                f"auto decision version {d.get('version')!r} is not supported "
                f"({_DECISION_VERSION}); start without --resume"
            )
        scheme = None if d["scheme"] == "dense" else parse_scheme(d["scheme"], adam=True)
        if scheme is not None and not isinstance(scheme, AdamMomentum | AdamUpdate):
            raise ConfigError(f"auto decision names {d['scheme']!r}, not an Adam scheme")
        return cls(**{**d, "scheme": scheme})


def dense_bucket_timings(
    numels: Sequence[int], *, bucket_cap_bytes: int, backward_s: float
) -> list[Any]:
    """DDP's fp32 buckets over parameters of ``numels`` (registration order), each ready when
    backward (taking ``backward_s``, spread in proportion to size) has reached its last
    parameter. Pure."""
    from superneurons.strategy.cost import BucketTiming

    total = sum(numels)
    buckets: list[BucketTiming] = []
    done = 0
    current: list[int] = []
    for index in reversed(range(len(numels))):  # backward produces the last layers first
        current.append(index)
        done += numels[index]
        if 4 * sum(numels[i] for i in current) >= bucket_cap_bytes or index == 0:
            names = tuple(f"p{i}" for i in current)
            ready_s = backward_s * done / total
            numel = sum(numels[i] for i in current)
            buckets.append(BucketTiming(",".join(names), names, numel, ready_s))
            current = []
    return buckets


def predict_adam_schemes(
    numels: Sequence[int],
    *,
    backward_s: float,
    network: Any,
    sign_cost: Any,
    wire_cost: Any,
    warmup_steps: int,
    total_steps: int,
    bucket_cap_bytes: int,
    optimizer_s: OptimizerTimes | None = None,
) -> tuple[float, float]:
    """(dense AdamW's predicted step, 1-bit Adam's mean predicted step over the run), in
    seconds from backward's start to the optimizer step's end. Pure; see the module docstring.

    ``optimizer_s``: each optimizer's measured local ``step()`` (1-bit Adam's includes its
    encode/decode: pass codec costs with zero times then); None: no optimizer time.
    """
    from superneurons.strategy.codecs import DENSE
    from superneurons.strategy.cost import BucketTiming, predicted_step_s

    if total_steps < 1:
        raise ConfigError(f"total_steps must be >= 1, got {total_steps}")
    buckets = dense_bucket_timings(numels, bucket_cap_bytes=bucket_cap_bytes, backward_s=backward_s)
    dense_s = predicted_step_s(
        buckets, {b.key: DENSE for b in buckets}, backward_s=backward_s, network=network
    )
    after = [BucketTiming("all", ("all",), sum(numels), backward_s)]
    warm_s = predicted_step_s(after, {"all": wire_cost}, backward_s=backward_s, network=network)
    sign_s = predicted_step_s(after, {"all": sign_cost}, backward_s=backward_s, network=network)
    if optimizer_s is not None:
        dense_s += optimizer_s.adamw_s
        warm_s += optimizer_s.warmup_s
        sign_s += optimizer_s.compressed_s
    warm = min(warmup_steps, total_steps)
    return dense_s, (warm * warm_s + (total_steps - warm) * sign_s) / total_steps


@dataclass(frozen=True)
class OptimizerTimes:
    """Measured local seconds of one ``step()``: AdamW, 1-bit Adam in its warm-up (fp16
    encode/decode) and after it (error feedback, sign encode, decode); collectives excluded."""

    adamw_s: float
    warmup_s: float
    compressed_s: float


def _optimizer_times(
    params: Sequence[torch.Tensor], world: int, solo: Any, repeats: int
) -> OptimizerTimes:
    """Time each optimizer on copies of ``params`` (with their gradients) on a one-rank group,
    so nothing is sent; 1-bit Adam decodes one payload instead of ``world`` (its decode of
    the others is added from a second decode of the same payloads, ``world - 1`` times)."""
    from superneurons.optim.adam import CompressedAdamW
    from superneurons.strategy.timing import time_call_s

    device = params[0].device

    def copies() -> list[torch.Tensor]:
        out = []
        for p in params:
            q = p.detach().clone().requires_grad_(True)
            q.grad = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            out.append(q)
        return out

    adamw = torch.optim.AdamW(copies(), lr=1e-3)
    dense = [time_call_s(adamw.step, device) for _ in range(repeats + 1)][1:]
    one_bit = CompressedAdamW(
        copies(),
        codec=SignSGDCodec(),
        warmup_steps=2,
        warmup_codec=Fp16Codec(),
        process_group=solo,
    )
    times = [time_call_s(one_bit.step, device) for _ in range(repeats + 2)]
    warm, after = times[1], statistics.median(times[2:])
    decode_s = 0.0
    if world > 1:  # the receiver decodes every rank's payload
        flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]).float()
        codec = SignSGDCodec()
        payload = codec.encode(flat)
        decode_s = time_call_s(lambda: codec.decode(payload), device) * (world - 1)
    return OptimizerTimes(statistics.median(dense), warm, after + decode_s)


def _backward_s(model: nn.Module, batch: tuple[Any, Any], loss_fn: Any, repeats: int) -> float:
    """Median seconds of one backward of ``model`` on ``batch`` (forward not counted)."""
    from superneurons.strategy.timing import time_call_s

    inputs, targets = batch
    device = next(model.parameters()).device
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up (allocation)
        loss = loss_fn(model(inputs), targets)
        times.append(time_call_s(loss.backward, device))
    return statistics.median(times[1:])


def decide_adam_scheme(
    model: nn.Module,
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    config: AdamAuto,
    total_steps: int,
    bucket_cap_bytes: int,
    group: dist.ProcessGroup | None = None,
    repeats: int = 3,
) -> AdamDecision:
    """Measure, predict, choose (collective: every rank calls it; rank 0 decides, broadcasts).

    Call before wrapping ``model`` in DDP: the timed backwards run on the bare model; its
    gradients are cleared and the RNG streams restored, so the training that follows is the
    same as without this call.
    """
    from superneurons.strategy.codecs import measure_codecs
    from superneurons.strategy.netmodel import measure_network, ring_network

    device = next(model.parameters()).device
    world = dist.get_world_size(group)
    network = measure_network(group, device=device)
    link = "measured"
    if config.link_bit_s is not None:
        network = ring_network(
            world,
            alpha_s=network.all_reduce.alpha_s,
            bandwidth_bytes_per_s=config.link_bit_s / 8,
        )
        link = f"stated: {format_rate(config.link_bit_s)} (ring model, not measured)"
    warmup = warmup_steps_for(total_steps, config)
    decision: list[Any] = [None]
    leader = dist.get_global_rank(group, 0) if group is not None else 0
    solo = dist.new_group([leader])  # collective: every rank creates it, rank 0 times in it
    if dist.get_rank(group) == 0:
        params = [p for p in model.parameters() if p.requires_grad]
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            backward_s = _backward_s(model, batch, loss_fn, repeats)
            sample = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
            sign, wire = (  # their time is inside the measured optimizer steps
                replace(cost, encode_s_per_byte=0.0, decode_s_per_byte=0.0)
                for cost in measure_codecs([SignSGDCodec(), Fp16Codec()], sample, world_size=world)[
                    1:
                ]
            )
            optimizer_s = _optimizer_times(params, world, solo, repeats)
        for p in params:
            p.grad = None
        dense_s, compressed_s = predict_adam_schemes(
            [p.numel() for p in params],
            backward_s=backward_s,
            network=network,
            sign_cost=sign,
            wire_cost=wire,
            warmup_steps=warmup,
            total_steps=total_steps,
            bucket_cap_bytes=bucket_cap_bytes,
            optimizer_s=optimizer_s,
        )
        pays = world > 1 and compressed_s < (1.0 - config.margin) * dense_s
        decision[0] = AdamDecision(
            scheme=one_bit_adam(warmup) if pays else None,
            warmup_steps=warmup,
            predicted_dense_step_s=dense_s,
            predicted_compressed_step_s=compressed_s,
            backward_s=backward_s,
            link=link,
            network=network.to_dict(),
            optimizer_s=asdict(optimizer_s),
        ).to_dict()
    dist.broadcast_object_list(decision, src=leader, group=group)
    chosen = AdamDecision.from_dict(decision[0])
    logger.info(
        "auto (Adam): %s — predicted step %.4f s dense vs %.4f s 1-bit Adam (link %s)",
        chosen.scheme_spec,
        chosen.predicted_dense_step_s,
        chosen.predicted_compressed_step_s,
        chosen.link,
    )
    return chosen
