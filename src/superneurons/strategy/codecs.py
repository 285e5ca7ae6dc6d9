"""What each candidate codec costs on this device: seconds per byte, bits per element, error.

The selection (:mod:`.select`) needs, per candidate, the compute it adds (encode before the
collective, decode after it), the bytes it puts on the wire, and how much it distorts the
gradient. Espresso (Z. Wang, H. Lin, Y. Zhu, T. S. E. Ng, "Hi-Speed DNN Training with
Espresso: Unleashing the Full Potential of Gradient Compression with Near-Optimal Usage
Strategies", EuroSys'23) shows these must be measured on the deployment's device: the same
codec is compute-bound on one machine and free on another.

Candidates are codec objects (and :class:`~superneurons.codecs.powersgd.PowerSGD`); dense, the
plain fp32 all-reduce, is :data:`DENSE`, whose ``codec`` is None. A cost names its candidate by
the object; its spec string is only for records.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from superneurons.codecs.cast import Bf16Codec, Fp16Codec
from superneurons.codecs.codec import Codec, decode_mean_into, subtract_decode
from superneurons.codecs.coding.chunkquant import dequantize_rows, quantize_rows
from superneurons.codecs.coding.orthogonal import forward_, inverse_, rademacher
from superneurons.codecs.powersgd import PowerSGD, orthogonalize_
from superneurons.codecs.qsgd import QSGDCodec
from superneurons.codecs.sparse.compacttopk import CompactTopKCodec
from superneurons.codecs.sparse.topk import TopKCodec
from superneurons.codecs.twophase import TwoPhase
from superneurons.codecs.twophase_stages import (
    StageScratch,
    decode_slices,
    owner_reduce,
    worker_encode,
)
from superneurons.errors import ConfigError
from superneurons.strategy.timing import time_call_s

__all__ = [
    "DEFAULT_CANDIDATES",
    "DENSE",
    "Candidate",
    "CodecCost",
    "measure_codecs",
]

logger = logging.getLogger("superneurons.strategy")

Candidate = Codec | PowerSGD | TwoPhase

# NOTE: a few densities per family, not a sweep: the selection is per bucket, and each
# candidate costs one encode/decode measurement at registration. Dense is always a candidate.
# The all-gathered ones (top-k, ctopk, qsgd) pay (P - 1) payloads per rank; the two-phase
# quantisers and the all-reduced ones (casts, PowerSGD) do not grow with P.
DEFAULT_CANDIDATES: tuple[Candidate, ...] = (
    Fp16Codec(),
    Bf16Codec(),
    PowerSGD(rank=1),
    PowerSGD(rank=4),
    TwoPhase(bits=1),
    TwoPhase(bits=4),
    TopKCodec(ratio=0.1),
    TopKCodec(ratio=0.01),
    CompactTopKCodec(),
    QSGDCodec(),
)

# PowerSGD's error on its first step (random Q) is far above its steady state, where Q is
# warm-started from the previous step (Vogels et al. 2019, §3): a few power iterations on the
# sample stand in for that warm start.
_POWERSGD_WARM_ITERS = 3


@dataclass(frozen=True)
class CodecCost:
    """One candidate codec measured on this device (see :func:`measure_codecs`); ``codec`` is
    None for dense (the plain fp32 all-reduce).

    ``collectives`` is the number of collective calls per bucket (PowerSGD: 2 all-reduces),
    each paying the link's latency α. ``feedback_s_per_byte`` is what error feedback adds to
    the encode when it is on (adding the residual in, computing the new one), measured with
    the hook's own operations (see :mod:`superneurons.ddp.reduce`). ``owner_s_per_byte``: the
    part of ``decode_s_per_byte`` that runs between a two-phase exchange's collectives, in the
    hook (the owner's decode, average and re-quantisation). For a two-phase candidate
    ``bits_per_element`` counts the all-to-all's input (every slice); the all-gather sends one
    slice of it.
    """

    codec: Candidate | None
    summable: bool
    encode_s_per_byte: float
    decode_s_per_byte: float
    bits_per_element: float
    rel_error: float
    collectives: int = 1
    feedback_s_per_byte: float = 0.0
    owner_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "encode_s_per_byte",
            "decode_s_per_byte",
            "bits_per_element",
            "rel_error",
            "feedback_s_per_byte",
            "owner_s_per_byte",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value >= 0.0 or math.isinf(value):
                raise ConfigError(f"CodecCost.{name} must be a finite number >= 0, got {value!r}")
        if self.collectives < 1:
            raise ConfigError(f"CodecCost.collectives must be >= 1, got {self.collectives}")

    @property
    def spec(self) -> str:
        """The candidate's spec string (``"dense"`` for dense), for records and logs."""
        return "dense" if self.codec is None else self.codec.spec

    @property
    def two_phase(self) -> bool:
        """A two-phase exchange: an all-to-all waited for in the hook, then an all-gather."""
        return isinstance(self.codec, TwoPhase)

    @property
    def low_rank(self) -> bool:
        """PowerSGD: held to the low-rank error budget (:func:`~.select.select`)."""
        return isinstance(self.codec, PowerSGD)

    def payload_bytes(self, numel: int) -> int:
        """Bytes one rank sends for a bucket of ``numel`` fp32 elements."""
        return math.ceil(self.bits_per_element * numel / 8)


# Plain fp32 all-reduce: nothing to encode, 32 bits, exact.
DENSE = CodecCost(None, True, 0.0, 0.0, 32.0, 0.0)


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up call (:func:`time_call_s` each)."""
    fn()
    times = sorted(time_call_s(fn, device) for _ in range(repeats))
    return times[len(times) // 2]


def _rel_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    norm = float(exact.norm())
    return float((approx - exact).norm()) / norm if norm > 0 else 0.0


def _as_matrix(sample: torch.Tensor) -> torch.Tensor:
    """A 2-D view of the sample for PowerSGD: as given if 2-D, else a near-square matrix of
    its first ``n·m`` elements (a flat sample carries no layer shape)."""
    if sample.dim() >= 2:
        return sample.reshape(sample.shape[0], -1)
    n = max(1, math.isqrt(sample.numel()))
    return sample[: n * (sample.numel() // n)].reshape(n, -1)


def _measure_powersgd(config: PowerSGD, sample: torch.Tensor, repeats: int) -> CodecCost:
    """PowerSGD timed with the operations, layouts and in-place writes of
    :func:`~superneurons.ddp.powersgd.powersgd_reduce` (when it timed other products, a route
    predicted at 0.52 s measured 0.93 s)."""
    matrix = _as_matrix(sample.float()).contiguous()  # (n, m)
    n, m = matrix.shape
    input_bytes = matrix.numel() * 4
    r = min(config.rank, n, m)
    gen = torch.Generator().manual_seed(0)
    qt0 = torch.randn(r, m, generator=gen).to(matrix.device)  # Qᵀ rows, as the hook keeps it
    work = matrix.clone()
    residual = torch.zeros_like(matrix)
    out = torch.empty_like(matrix)
    p_hat = orthogonalize_(torch.mm(qt0, matrix.t()).t())

    def encode() -> torch.Tensor:  # P = (Qᵀ Mᵀ)ᵀ, orthogonalise, Qᵀ = P̂ᵀ M
        return torch.mm(orthogonalize_(torch.mm(qt0, matrix.t()).t()).t(), matrix)

    def decode() -> torch.Tensor:  # P̂ Q̄ᵀ written into the bucket
        return torch.mm(p_hat, qt0, out=out)

    def feedback() -> torch.Tensor:  # M += residual; residual = M - P̂ Qᵀ
        work.add_(residual)
        return torch.addmm(work, p_hat, qt0, alpha=-1, out=residual)

    qt = qt0
    for _ in range(_POWERSGD_WARM_ITERS):
        p_hat_i = orthogonalize_(torch.mm(qt, matrix.t()).t())
        qt = torch.mm(p_hat_i.t(), matrix)
    approx = p_hat_i @ qt
    compressed = config.matrix_shape((n, m)) is not None
    return CodecCost(
        codec=config,
        summable=True,
        encode_s_per_byte=_timed(encode, matrix.device, repeats) / input_bytes,
        decode_s_per_byte=_timed(decode, matrix.device, repeats) / input_bytes,
        bits_per_element=(r * (n + m) * 32 / (n * m)) if compressed else 32.0,
        rel_error=_rel_error(approx, matrix) if compressed else 0.0,
        collectives=2,
        feedback_s_per_byte=_timed(feedback, matrix.device, repeats) / input_bytes,
    )


def _measure_cast(codec: Codec, flat: torch.Tensor, repeats: int, world_size: int) -> CodecCost:
    """A cast codec timed as the hook runs it (``reduce._cast_reduce``): divide into a kept
    float32 buffer, cast into the kept wire buffer; decode = cast straight into the bucket."""
    payload = codec.encode(flat)
    scaled = torch.empty_like(flat)
    wire = torch.empty_like(payload.data.reshape(-1))
    out, residual = flat.clone(), torch.zeros_like(flat)

    def encode() -> torch.Tensor:
        return wire.copy_(torch.div(flat, world_size, out=scaled))

    def decode() -> torch.Tensor:
        return out.copy_(wire)

    def feedback() -> torch.Tensor:  # c += r; r = c - decode · P
        out.add_(residual)
        residual.copy_(wire)
        return torch.sub(out, residual, alpha=world_size, out=residual)

    input_bytes = flat.numel() * 4
    return CodecCost(
        codec=codec,
        summable=True,
        encode_s_per_byte=_timed(encode, flat.device, repeats) / input_bytes,
        decode_s_per_byte=_timed(decode, flat.device, repeats) / input_bytes,
        bits_per_element=codec.payload_bytes(flat.numel()) * 8 / flat.numel(),
        rel_error=_rel_error(codec.decode(payload), flat),
        feedback_s_per_byte=_timed(feedback, flat.device, repeats) / input_bytes,
    )


def _measure_twophase(
    config: TwoPhase, flat: torch.Tensor, repeats: int, world_size: int
) -> CodecCost:
    """A two-phase candidate timed with the hook's own stages (:mod:`superneurons.codecs.
    twophase_stages`, the functions :mod:`superneurons.ddp.twophase` calls) on one process:
    the worker's transform, quantisation and packing (encode; with its residual: feedback);
    the owner's decode of every rank's slice, their average and re-quantisation (owner);
    every owner's slice decoded and transformed back (decode)."""
    if config.bits == 32:
        raise ConfigError("twophase:bits=32 is lossless: not a candidate (use dense)")
    layout = config.layout(flat.numel(), world_size)
    device, n, cols = flat.device, layout.padded_numel, layout.cols
    padded = torch.zeros(n, device=device)
    padded[: flat.numel()] = flat
    signs = rademacher(0, "sample", cols, device)
    x = torch.empty(n, device=device)
    residual, error, out = (torch.zeros(n, device=device) for _ in range(3))
    owner_residual, owner_error = (torch.zeros(layout.slice_numel, device=device) for _ in "ab")
    message = torch.zeros(world_size, layout.slice_bytes, dtype=torch.uint8, device=device)
    owned = torch.zeros(1, layout.slice_bytes, dtype=torch.uint8, device=device)
    scratch = StageScratch.make(
        layout, lambda _, numel, dtype: torch.empty(numel, dtype=dtype, device=device), device
    )
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (layout.rows, cols)

    def worker(feedback: bool) -> bool:
        rows = forward_(x.copy_(padded).view(-1, cols), config.transform, signs)
        return worker_encode(
            rows, message, layout, config, scratch, generator=gen,
            residual=residual.view_as(rows) if feedback else None,
            error=error.view_as(rows) if feedback else None,
        )  # fmt: skip

    def owner() -> bool:
        return owner_reduce(
            message, owned, layout, config, scratch, generator=gen,
            residual=owner_residual.view(shape), error=owner_error.view(shape),
        )  # fmt: skip

    def decode() -> object:
        rows = decode_slices(message, out.view(-1, cols), layout, config, scratch)
        return inverse_(rows, config.transform, signs)

    worker(False)  # a valid message for the decodes
    input_bytes = flat.numel() * 4
    encode_s = _timed(lambda: worker(False), device, repeats)
    feedback_s = max(0.0, _timed(lambda: worker(True), device, repeats) - encode_s)
    owner_s = _timed(owner, device, repeats) / input_bytes
    # one-shot error: the worker's quantisation, then the owner's of what it decoded
    rows = forward_(padded.clone().view(-1, cols), config.transform, signs)
    once = rows
    for _ in range(2):
        q, s = quantize_rows(once, bits=config.bits, rounding=config.rounding, generator=gen)
        once = dequantize_rows(q, s, bits=config.bits)
    approx = inverse_(once, config.transform, signs).reshape(-1)[: flat.numel()]
    return CodecCost(
        codec=config,
        summable=True,
        encode_s_per_byte=encode_s / input_bytes,
        decode_s_per_byte=owner_s + _timed(decode, device, repeats) / input_bytes,
        bits_per_element=world_size * layout.slice_bytes * 8 / flat.numel(),
        rel_error=_rel_error(approx, flat),
        collectives=2,
        feedback_s_per_byte=feedback_s / input_bytes,
        owner_s_per_byte=owner_s,
    )


def _measure_codec(codec: Codec, flat: torch.Tensor, repeats: int, world_size: int) -> CodecCost:
    """A gathered codec timed as the hook runs it (``reduce._gathered_reduce``): encode of the
    compensated gradient; ``decode_mean_into`` of ``world_size`` payloads into the bucket;
    feedback = the compensation into a kept slab plus ``subtract_decode`` of its own payload
    (sparse for the sparsifiers)."""
    if codec.summable:
        return _measure_cast(codec, flat, repeats, world_size)
    gen = torch.Generator(device=flat.device).manual_seed(0)
    payload = codec.encode(flat, generator=gen)
    receive = [payload] * world_size
    slab, residual, out = flat.clone(), torch.zeros_like(flat), torch.empty_like(flat)

    def encode() -> object:
        return codec.encode(flat, generator=gen)

    def decode() -> object:
        return decode_mean_into(codec, receive, out, world_size)

    def feedback() -> object:  # slab = g + r; slab -= decode(own payload)
        return subtract_decode(codec, payload, torch.add(flat, residual, out=slab))

    input_bytes = flat.numel() * 4
    return CodecCost(
        codec=codec,
        summable=codec.summable,
        encode_s_per_byte=_timed(encode, flat.device, repeats) / input_bytes,
        decode_s_per_byte=_timed(decode, flat.device, repeats) / (input_bytes * len(receive)),
        bits_per_element=codec.payload_bytes(flat.numel()) * 8 / flat.numel(),
        rel_error=_rel_error(codec.decode(payload), flat),
        feedback_s_per_byte=_timed(feedback, flat.device, repeats) / input_bytes,
    )


def measure_codecs(
    codecs: Sequence[Candidate],
    sample: torch.Tensor,
    *,
    repeats: int = 3,
    world_size: int = 2,
) -> list[CodecCost]:
    """Measure every codec on ``sample`` (a real gradient, on the device training runs on).

    * ``encode_s_per_byte``: median encode time / the sample's fp32 bytes;
    * ``decode_s_per_byte``: median ``decode_sum`` time of ``world_size`` payloads / (bytes ·
      ``world_size``) for gathered codecs (the receiver decodes one payload per rank),
      ``decode`` time / bytes for summable ones;
    * ``bits_per_element``: ``payload_bytes(numel) · 8 / numel`` at the sample's size;
    * ``rel_error``: ``‖decode(encode(g)) − g‖ / ‖g‖`` once (no error feedback; two-phase:
      the worker's quantisation then the owner's);
    * ``feedback_s_per_byte``: error feedback's extra work per byte, as the hook does it.

    A codec that raises on this device is logged and left out.

    :data:`DENSE` is always first in the result. The measurement is local; to make ranks
    agree, measure on rank 0 and broadcast, or agree by an all-reduce MAX of the times.
    """
    if not isinstance(sample, torch.Tensor) or not sample.is_floating_point():
        raise ConfigError("measure_codecs needs a floating-point sample gradient")
    if sample.numel() < 16:
        raise ConfigError(f"the sample gradient is too small to time ({sample.numel()} elements)")
    if repeats < 1 or world_size < 1:
        raise ConfigError("measure_codecs: repeats >= 1 and world_size >= 1")
    flat = sample.detach().reshape(-1).float()
    costs = [DENSE]
    for codec in codecs:
        try:
            if isinstance(codec, PowerSGD):
                costs.append(_measure_powersgd(codec, sample.detach(), repeats))
            elif isinstance(codec, TwoPhase):
                costs.append(_measure_twophase(codec, flat, repeats, world_size))
            else:
                costs.append(_measure_codec(codec, flat, repeats, world_size))
        except (RuntimeError, ConfigError) as exc:
            # NOTE: a codec that cannot run here (e.g. a CPU-only decode on CUDA)
            # is not a candidate; the others still are.
            logger.warning("strategy: candidate %s skipped: %s", codec.spec, exc)
    return costs
