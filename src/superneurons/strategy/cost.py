"""Predicted step time of a per-bucket codec choice: how much communication backward hides.

Data-parallel backward produces gradient buckets one after another; each bucket's collective
can run while backward computes the rest (wait-free backpropagation, Poseidon: Zhang et al.,
ATC'17). What costs time is only the communication still running when backward ends: the
*exposed* part. Compressing a bucket whose all-reduce is already hidden buys nothing and
costs its encode; compressing the bucket that is ready last pays most (Espresso, EuroSys'23).

The timeline (pure arithmetic over measured numbers, see :func:`predicted_step_s`):

* one compute resource runs backward and the hook's encodes/decodes in turn: the hook runs
  inside backward (CPU) or on the backward stream (CUDA), so an encode delays every bucket
  ready after it and backward's end by its own duration;
* one link carries the buckets' collectives in the order they are encoded; a bucket's
  collective starts at ``max(ready + encode delays, link free)`` and takes the network
  model's time for its payload (all-reduce when summable, all-gather otherwise), plus one
  latency α per extra collective (PowerSGD: two); PowerSGD's first all-reduce is waited for
  inside the hook, so it stalls backward until the link is free and that all-reduce is done;
  so is a two-phase exchange's all-to-all (its whole payload), followed in the hook by the
  owner's work, then an all-gather of one slice (1/P of the payload), asynchronously;
* decodes run on the compute resource after backward, in the order the collectives end;
* the step ends when backward, the last collective and the last decode are all done.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from superneurons.errors import ConfigError
from superneurons.strategy.codecs import CodecCost
from superneurons.strategy.netmodel import NetworkModel

__all__ = ["BucketTiming", "bucket_key", "predicted_step_s"]


def bucket_key(params: Sequence[str]) -> str:
    """Stable bucket signature: the sorted parameter names joined by ``","``.

    NOTE: not DDP's bucket index, which changes when DDP rebuilds its buckets after the first
    step and again after a resume.
    """
    return ",".join(sorted(params))


@dataclass(frozen=True)
class BucketTiming:
    """One gradient bucket as measured during dense steps.

    ``ready_s``: seconds after backward started when the bucket was handed to the hook.
    """

    key: str
    params: tuple[str, ...]
    numel: int
    ready_s: float

    def __post_init__(self) -> None:
        if self.numel < 1:
            raise ConfigError(f"bucket {self.key!r}: numel must be >= 1, got {self.numel}")
        if not self.ready_s >= 0.0:
            raise ConfigError(f"bucket {self.key!r}: ready_s must be >= 0, got {self.ready_s}")
        object.__setattr__(self, "params", tuple(self.params))


def _comm_s(cost: CodecCost, numel: int, network: NetworkModel) -> float:
    """Wire seconds of one bucket under ``cost`` (summable: all-reduce; else all-gather;
    two-phase: an all-to-all of the payload and an all-gather of one slice)."""
    if cost.two_phase:
        return _first_s(cost, numel, network) + _gather_slice_s(cost, numel, network)
    link = network.all_reduce if cost.summable else network.all_gather
    return link.time_s(cost.payload_bytes(numel)) + (cost.collectives - 1) * link.alpha_s


def _first_s(cost: CodecCost, numel: int, network: NetworkModel) -> float:
    """Seconds of the collective the hook waits for: PowerSGD's first all-reduce (about half
    the payload), a two-phase exchange's all-to-all (all of it)."""
    if cost.two_phase:
        return network.alltoall.time_s(cost.payload_bytes(numel))
    link = network.all_reduce if cost.summable else network.all_gather
    return link.time_s(cost.payload_bytes(numel) // 2)


def _gather_slice_s(cost: CodecCost, numel: int, network: NetworkModel) -> float:
    return network.all_gather.time_s(-(-cost.payload_bytes(numel) // network.world_size))


def _decode_s(cost: CodecCost, numel: int, world_size: int) -> float:
    """Decode seconds after the collectives: gathered codecs decode one payload per rank; a
    two-phase exchange decodes every owner's slice once (its owner stage runs in the hook)."""
    payloads = 1 if cost.summable else world_size
    return (cost.decode_s_per_byte - cost.owner_s_per_byte) * 4 * numel * payloads


def predicted_step_s(
    buckets: Sequence[BucketTiming],
    choices: Mapping[str, CodecCost],
    *,
    backward_s: float,
    network: NetworkModel,
) -> float:
    """Seconds from backward's start until every bucket is averaged (see the module docstring).

    Args:
        buckets: the buckets with their measured ready times (any order).
        choices: bucket key -> the chosen candidate's measured cost.
        backward_s: seconds backward computes (measured with dense, hook overhead excluded).
        network: the fitted all-reduce/all-gather lines.

    Raises:
        ConfigError: a bucket without a choice, or a negative ``backward_s``.
    """
    if not backward_s >= 0.0:
        raise ConfigError(f"backward_s must be >= 0, got {backward_s}")
    missing = [b.key for b in buckets if b.key not in choices]
    if missing:
        raise ConfigError(f"no codec chosen for bucket(s) {missing}")
    delay_s = 0.0  # encode time inserted into backward so far
    link_free_s = 0.0
    comm_ends: list[tuple[float, float]] = []  # (collective end, decode seconds)
    for bucket in sorted(buckets, key=lambda b: (b.ready_s, b.key)):
        cost = choices[bucket.key]
        encode_s = cost.encode_s_per_byte * 4 * bucket.numel
        comm_s = _comm_s(cost, bucket.numel, network)
        if cost.two_phase:
            # the all-to-all is waited for in the hook, then the owner's decode and
            # re-quantisation run there too; the all-gather of one slice is asynchronous
            now_s = bucket.ready_s + delay_s
            first_end_s = max(now_s + encode_s, link_free_s) + _first_s(cost, bucket.numel, network)
            start_s = first_end_s + cost.owner_s_per_byte * 4 * bucket.numel
            delay_s += start_s - now_s
            link_free_s = start_s + _gather_slice_s(cost, bucket.numel, network)
        elif cost.collectives > 1:
            # PowerSGD: its first all-reduce (P, about half the payload) is waited for in the
            # hook, so backward stalls until the link is free and P is summed; the second
            # half of the encode follows, then the second all-reduce runs asynchronously.
            first_s = _first_s(cost, bucket.numel, network)
            now_s = bucket.ready_s + delay_s
            first_end_s = max(now_s + encode_s / 2, link_free_s) + first_s
            delay_s += first_end_s + encode_s / 2 - now_s
            start_s = first_end_s + encode_s / 2
            link_free_s = start_s + max(comm_s - first_s, 0.0)
        else:
            delay_s += encode_s
            start_s = max(bucket.ready_s + delay_s, link_free_s)
            link_free_s = start_s + comm_s
        comm_ends.append((link_free_s, _decode_s(cost, bucket.numel, network.world_size)))
    compute_free_s = backward_s + delay_s
    for end_s, decode_s in sorted(comm_ends):
        compute_free_s = max(compute_free_s, end_s) + decode_s
    return max(compute_free_s, link_free_s)
