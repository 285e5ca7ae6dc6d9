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

Both predictions are :func:`superneurons.strategy.cost.predicted_step_s` on a network model
plus each optimizer's measured local ``step()`` (1-bit Adam's per-parameter encode, error
feedback and decode are Python loops that per-byte codec costs missed). 1-bit Adam is chosen
only when its mean predicted step is at least ``margin`` (20%) below dense's. Rank 0 decides
and broadcasts, so every rank builds the same optimizer.

The decision is the pure :func:`choose_adam_scheme` of three inputs, each recorded in it:

* the network: fitted on the real process group
  (:func:`~superneurons.strategy.netmodel.measure_network`), or, with ``auto:link=RATE
  [,latency=T]``, *stated*: :func:`~superneurons.strategy.netmodel.stated_network` of that rate
  and latency (:data:`~superneurons.schemes.adam.DEFAULT_LATENCY_NS` when none is stated), and
  then nothing of the network is measured: for planning a deployment from a test machine,
  labelled as such in every record;
* the model: its parameters' sizes (the buckets, the bytes on the wire: the codecs' payload
  sizes are exact, not measured);
* this device's compute, which no link statement covers (:class:`ComputeTimes`: backward and
  each optimizer's ``step()``, 1-bit Adam's codec work inside it): measured on rank 0 by
  :func:`measure_compute`, or stated (``compute=``, e.g. an earlier decision's record). A
  measurement is taken at whatever load the machine has; with a stated link and stated compute
  the decision is a function of the statement alone, whatever runs beside it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from superneurons.codecs.cast import Fp16Codec
from superneurons.codecs.sign import SignSGDCodec
from superneurons.durations import format_duration
from superneurons.errors import ConfigError
from superneurons.optim.stepcost import ComputeTimes, OptimizerTimes, measure_compute
from superneurons.rates import format_rate
from superneurons.schemes.adam import AdamAuto, AdamMomentum, AdamScheme, AdamUpdate
from superneurons.schemes.grammar import parse_scheme

__all__ = [
    "AdamDecision",
    "ComputeTimes",
    "OptimizerTimes",
    "choose_adam_scheme",
    "decide_adam_scheme",
    "dense_bucket_timings",
    "measure_compute",
    "one_bit_adam",
    "predict_adam_schemes",
    "stated_link",
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
    link: str  # "measured" or "stated: 100mbit, latency 44us (ring model, not measured)"
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


def _wire_cost(codec: Any, numel: int) -> Any:
    """What ``codec`` puts on the wire for ``numel`` fp32 elements, exactly (its payload size);
    its compute is inside the measured optimizer steps, so none is added here."""
    from superneurons.strategy.codecs import CodecCost

    bits = codec.payload_bytes(numel) * 8 / numel
    # NOTE: rel_error is the selection's (strategy.select); the timeline does not read it.
    return CodecCost(codec, codec.summable, 0.0, 0.0, bits, 0.0)


def stated_link(config: AdamAuto, world_size: int) -> tuple[Any, str]:
    """The network ``auto:link=RATE[,latency=T]`` states, and its label for the records. Pure:
    nothing is measured. Needs ``config.link_bit_s``."""
    from superneurons.strategy.netmodel import stated_network

    if config.link_bit_s is None:
        raise ConfigError("auto: no link is stated (write link=RATE, e.g. auto:link=100mbit)")
    network = stated_network(
        world_size, rate_bit_s=config.link_bit_s, latency_s=config.latency_ns / 1e9
    )
    rate, latency = format_rate(config.link_bit_s), format_duration(config.latency_ns)
    return network, f"stated: {rate}, latency {latency} (ring model, not measured)"


def choose_adam_scheme(
    numels: Sequence[int],
    *,
    config: AdamAuto,
    network: Any,
    link: str,
    compute: ComputeTimes,
    total_steps: int,
    bucket_cap_bytes: int,
) -> AdamDecision:
    """Dense AdamW or 1-bit Adam for a model of parameters of ``numels`` (registration order)
    on ``network`` (labelled ``link`` in the record) with ``compute``. Pure: the same inputs
    give the same decision (see the module docstring)."""
    warmup = warmup_steps_for(total_steps, config)
    numel = sum(numels)
    dense_s, compressed_s = predict_adam_schemes(
        numels,
        backward_s=compute.backward_s,
        network=network,
        sign_cost=_wire_cost(SignSGDCodec(), numel),
        wire_cost=_wire_cost(Fp16Codec(), numel),
        warmup_steps=warmup,
        total_steps=total_steps,
        bucket_cap_bytes=bucket_cap_bytes,
        optimizer_s=compute.optimizer,
    )
    pays = network.world_size > 1 and compressed_s < (1.0 - config.margin) * dense_s
    return AdamDecision(
        scheme=one_bit_adam(warmup) if pays else None,
        warmup_steps=warmup,
        predicted_dense_step_s=dense_s,
        predicted_compressed_step_s=compressed_s,
        backward_s=compute.backward_s,
        link=link,
        network=network.to_dict(),
        optimizer_s=asdict(compute.optimizer),
    )


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
    compute: ComputeTimes | None = None,
) -> AdamDecision:
    """Measure what is not stated, predict, choose (collective: every rank calls it, with the
    same ``config`` and ``compute``; rank 0 decides and broadcasts).

    The network is measured on ``group`` unless ``config`` states a link; the compute is
    measured on rank 0 (:func:`measure_compute`) unless ``compute`` states it. Call before
    wrapping ``model`` in DDP: the timed backwards run on the bare model; its gradients are
    cleared and the RNG streams restored, so the training that follows is the same as without
    this call.
    """
    from superneurons.strategy.netmodel import measure_network

    device = next(model.parameters()).device
    world = dist.get_world_size(group)
    if config.link_bit_s is None:
        network, link = measure_network(group, device=device), "measured"
    else:
        network, link = stated_link(config, world)
    leader = dist.get_global_rank(group, 0) if group is not None else 0
    # collective: every rank creates it (or none does: compute is the same on every rank)
    solo = dist.new_group([leader]) if compute is None else None
    decision: list[Any] = [None]
    if dist.get_rank(group) == 0:
        if compute is None:
            compute = measure_compute(
                model, batch, loss_fn, world_size=world, solo=solo, repeats=repeats
            )
        numels = [p.numel() for p in model.parameters() if p.requires_grad]
        decision[0] = choose_adam_scheme(
            numels,
            config=config,
            network=network,
            link=link,
            compute=compute,
            total_steps=total_steps,
            bucket_cap_bytes=bucket_cap_bytes,
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
