"""FFT gradient sparsification with range-float values (HPDC'20's codec).

Wang et al., "FFT-based Gradient Sparsification for the Distributed Training of Deep Neural
Networks", HPDC 2020 (arXiv 1811.08596): transform the flat gradient with a real FFT, drop the
``theta`` fraction of frequency coefficients with the smallest magnitude, quantize the kept
real/imaginary parts with a range-based float (:mod:`superneurons.compress.rangefloat`) and send
them with a fixed-size index code (:mod:`superneurons.compress.indexcode`). The paper gives no
code; the pipeline below is our reconstruction (CONTEXT.md section 2).

Pipeline for ``numel = n``: split into ``C`` chunks of length ``L`` (``chunk = 0``: one chunk of
``n``; otherwise ``L = min(chunk, n)``, the last chunk zero-padded), ``rfft`` each chunk to
``B = L // 2 + 1`` bins, ``T = C * B`` bins in all. Keep exactly
``k = T - floor(theta * T)`` bins, those with the largest *multiplicity-weighted* power
``w * |X|**2`` (``w = 1`` for bin 0 and, for even ``L``, bin ``L / 2``; ``w = 2`` otherwise).

Parseval bound (tested): by Parseval ``||g||**2 = (1/L) * sum(w * |X|**2)`` over all bins, and
the dropped bins carry the ``T - k`` smallest weighted powers, so at most a ``(T - k)/T <= theta``
share of the energy: ``||g_hat - g||**2 / ||g||**2 <= theta`` before quantization. Zero padding
adds no energy and decoding truncates it, so chunking keeps the bound.

Payload (fixed size, depends only on ``n`` and the hyper-parameters)::

    [range-float header, 8 B][index code: bitmap ceil(T/8) B or Elias-Fano][2k values]

values are the kept bins' (real, imag) pairs in index order, ``bits`` each (``bits = 32``:
raw float32, lossless values; then ``theta = 0`` round-trips to float32 FFT tolerance, ~1e-6
relative, not bit-exactly). Linearity lets :meth:`FFTCodec.decode_sum` scatter every rank's
kept bins into one spectrum and run a single inverse FFT.

Selection: ``select="exact"`` takes ``torch.topk``; ``select="sampled"`` brackets the k-th
largest score between two quantiles of a strided sample (in the spirit of DGC's sampled
threshold, Lin et al., ICLR 2018), keeps every bin above the upper one and ranks only the
narrow band in between exactly, so it keeps the *same* k bins as exact (ties aside; it falls
back to exact when the sample misses, ~0.1% of calls) at a fraction of the cost.

Values: one range-float window per message, from the largest kept part down to the weakest
kept bin's ``|X| / sqrt(2)`` (the paper's ``[threshold, max]`` rule, so smaller parts fall
into the subnormal step). Index: "gap" (Elias-Fano) is smaller than "bitmap" for
``theta > 0.75`` (1.08 vs 1.31 bits/element at 0.9, see benchmarks/fft_throughput.py) at about
the same speed; bitmap stays the default for simplicity. Device: encode runs on the CPU (a CUDA
gradient is copied over); payloads and decodes are CPU tensors.

NaN/Inf policy (project-wide): ``encode`` never raises on values. A non-finite input gives a
NaN header scale; such a payload decodes to all-NaN, and ``decode_sum`` over payloads of which
any is non-finite is all-NaN, so a DDP hook propagates it as a dense all-reduce would and
AMP's ``GradScaler`` skips the step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from superneurons.compress.bitpack import packed_bytes
from superneurons.compress.codec import Payload, check_gradient
from superneurons.compress.indexcode import (
    INDEX_KINDS,
    decode_bitmap,
    decode_gap,
    encode_bitmap,
    encode_gap,
    index_bytes,
)
from superneurons.compress.rangefloat import (
    HEADER_BYTES,
    RangeFloatHeader,
    check_bits,
    dequantize,
    quantize,
    read_codes,
    write_codes,
)
from superneurons.errors import ConfigError

__all__ = ["SELECTS", "FFTCodec", "kept_count", "select_bins", "spectrum_layout"]

logger = logging.getLogger("superneurons.compress")

SELECTS: tuple[str, ...] = ("exact", "sampled")
_SAMPLE_SIZE = 16384  # scores sampled (strided) to bracket the threshold (select="sampled")
_MARGIN_SIGMAS = 3.0  # lower the sampled quantile by this many binomial standard errors
# NOTE: at 3 sigma the sample undershoots (exact fallback, ~2x slower) in ~0.1% of calls.


def spectrum_layout(numel: int, chunk: int) -> tuple[int, int]:
    """``(length L, chunks C)`` of the chunked transform of ``numel`` elements."""
    length = numel if chunk == 0 else min(chunk, numel)
    return length, -(-numel // length)


def kept_count(universe: int, theta: float) -> int:
    """Bins kept out of ``universe``: ``T - floor(theta * T)``, at least 1 (fixed, data-free).

    ``floor`` keeps the dropped share ``<= theta`` even when ``theta * T`` rounds low.
    """
    return max(1, universe - math.floor(theta * universe))


def _bin_score(parts: torch.Tensor, length: int) -> torch.Tensor:
    """Per-bin ranking score ``w * |X|**2 / 2``; ``parts`` is ``(C, B, 2)``, result ``(C * B,)``.

    Halving the two unpaired bins (0 and, for even ``L``, ``L / 2``) instead of doubling the
    others gives the same order at a fraction of the cost. ``score <= |X|**2`` everywhere.
    """
    squares = torch.view_as_complex(parts * parts)  # (C, B): re**2 + 1j * im**2
    by_chunk = squares.real + squares.imag  # (C, B); ~2x faster than addcmul on strided views
    by_chunk[:, 0] *= 0.5
    if length % 2 == 0 and length > 1:
        by_chunk[:, length // 2] *= 0.5
    return by_chunk.reshape(-1)


def select_bins(
    score: torch.Tensor, count: int, select: str, *, period: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, indices)`` of exactly ``count`` bins with the largest ``score``: a bool mask
    over all bins and the kept bin indices in increasing order. ``period``: bins per chunk
    (the sampled threshold avoids strides that alias with it)."""
    universe = score.numel()
    if count >= universe:
        return torch.ones(universe, dtype=torch.bool), torch.arange(universe)
    if select == "sampled" and universe > 4 * _SAMPLE_SIZE:
        chosen = _select_sampled(score, count, period)
        if chosen is not None:
            return chosen
    mask = torch.zeros(universe, dtype=torch.bool)
    mask[torch.topk(score, count, sorted=False).indices] = True
    return mask, mask.nonzero().reshape(-1)


def _sample_stride(universe: int, period: int) -> int:
    """A stride giving ~_SAMPLE_SIZE samples that is coprime with the bins per chunk, so the
    strided sample visits every frequency of the chunks instead of aliasing onto a few."""
    stride = max(1, universe // _SAMPLE_SIZE)
    while math.gcd(stride, period) != 1:
        stride += 1
    return stride


def _select_sampled(
    score: torch.Tensor, count: int, period: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Two thresholds from one strided sample bracket the count-th largest score: bins above
    the high one are surely kept, bins between the two (~2 * margin * T) are ranked exactly."""
    universe = score.numel()
    sample = score[:: _sample_stride(universe, period)].contiguous()  # (s,)
    size = sample.numel()
    drop_share = 1.0 - count / universe
    margin = _MARGIN_SIGMAS * math.sqrt(drop_share * (1 - drop_share) / size)
    low_rank = max(1, math.floor(size * (drop_share - margin)))
    high_rank = min(size, math.ceil(size * (drop_share + margin)))
    low = torch.kthvalue(sample, low_rank).values
    high = torch.kthvalue(sample, high_rank).values
    mask = score >= low  # (T,): a superset of the top `count` unless the sample erred
    candidates = mask.nonzero().reshape(-1)  # (c,), increasing
    candidate_score = score.index_select(0, candidates)  # (c,)
    keep = candidate_score > high  # (c,): surely among the top `count`
    missing = count - int(keep.sum())
    band = (~keep).nonzero().reshape(-1)  # (b,): positions in `candidates` to rank exactly
    if not 0 <= missing <= band.numel():
        logger.debug("sampled thresholds missed the %d-th largest; exact fallback", count)
        return None
    if missing:
        ranked = torch.topk(candidate_score.index_select(0, band), missing, sorted=False)
        keep[band.index_select(0, ranked.indices)] = True
    mask[torch.masked_select(candidates, ~keep)] = False
    return mask, torch.masked_select(candidates, keep)


@dataclass(frozen=True)
class FFTCodec:
    """rFFT → keep the ``1 - theta`` strongest bins → range-float values + fixed-size index.

    ``theta``: fraction of bins dropped, in [0, 1). ``bits``: range-float width of each kept
    real/imag part (32 = raw float32). ``chunk``: transform length (0 = the whole bucket;
    powers of two are fastest; the last chunk is zero-padded).
    ``select``: "exact" | "sampled" (same kept set, see module doc). ``index``: "bitmap" | "gap" | "auto" (the smaller).
    """

    NAME: ClassVar[str] = "fft"
    theta: float = 0.9
    bits: int = 8
    # NOTE: defaults chosen by benchmarks/fft_throughput.py (1 thread, 2**20 fp32, theta=0.9):
    # a whole-bucket rfft alone runs at ~0.22 GB/s, so chunk=0 cannot reach the 0.5 GB/s target;
    # chunks of 256-4096 all encode at ~0.5-0.7 GB/s and decode at ~0.7-1.0 GB/s (shared
    # machine, thread CPU time), smaller being faster. On a real MLP gradient the error is
    # lowest at 512-1024 (0.35/0.34 vs 0.55 for the whole bucket); 512 keeps encode margin over
    # the target. "sampled" keeps the same bins as "exact" at 1.5-2x the encode speed.
    chunk: int = 512
    select: str = "sampled"
    # NOTE: "auto" picks, per bucket size, whichever fixed-size index code is smaller: the
    # Elias-Fano gap code wins for theta > ~0.75 (1.08 vs 1.31 bits/element at theta=0.9,
    # 0.13 vs 0.58 at 0.99) at the same encode/decode speed (benchmarks/fft_throughput.py);
    # the bitmap wins below. Both sides compute the same choice from (numel, theta, chunk).
    index: str = "auto"

    def __post_init__(self) -> None:
        theta = self.theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)):
            raise ConfigError(f"fft: theta must be a number in [0, 1), got {theta!r}")
        if not 0.0 <= theta < 1.0:
            raise ConfigError(
                f"fft: theta={theta} is the fraction of coefficients dropped and must be in "
                "[0, 1); e.g. theta=0.9 keeps 10%"
            )
        object.__setattr__(self, "theta", float(theta))
        check_bits(self.bits, owner=self.NAME)
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 0:
            raise ConfigError(
                f"fft: chunk={self.chunk!r} must be an integer >= 0 (0 = whole bucket; "
                "powers of two such as 4096 are fastest)"
            )
        if self.select not in SELECTS:
            raise ConfigError(f"fft: select={self.select!r} is unknown; use one of {list(SELECTS)}")
        if self.index not in (*INDEX_KINDS, "auto"):
            raise ConfigError(
                f"fft: index={self.index!r} is unknown; use one of {[*INDEX_KINDS, 'auto']}"
            )

    def index_kind(self, numel: int) -> str:
        """The index code used for a bucket of ``numel`` elements ("bitmap" or "gap")."""
        if self.index != "auto":
            return self.index
        _, _, universe, kept = self._sizes(numel)
        sizes = {kind: index_bytes(kind, universe, kept) for kind in INDEX_KINDS}
        return min(INDEX_KINDS, key=lambda kind: (sizes[kind], kind != "bitmap"))

    @property
    def spec(self) -> str:
        return (
            f"{self.NAME}:theta={self.theta!r},bits={self.bits},chunk={self.chunk},"
            f"select={self.select},index={self.index}"
        )

    @property
    def summable(self) -> bool:
        return False

    def _sizes(self, numel: int) -> tuple[int, int, int, int]:
        """``(L, C, T, k)`` for a gradient of ``numel`` elements."""
        if numel <= 0:
            raise ConfigError(f"{self.NAME}: numel must be positive, got {numel}")
        length, chunks = spectrum_layout(numel, self.chunk)
        universe = chunks * (length // 2 + 1)
        return length, chunks, universe, kept_count(universe, self.theta)

    def _value_bytes(self, kept: int) -> int:
        return 8 * kept if self.bits == 32 else packed_bytes(2 * kept, self.bits)

    def payload_bytes(self, numel: int) -> int:
        _, _, universe, kept = self._sizes(numel)
        kind = self.index_kind(numel)
        return HEADER_BYTES + index_bytes(kind, universe, kept) + self._value_bytes(kept)

    def encode(self, grad: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        del generator  # deterministic: selection is exact, rounding is to nearest
        flat = check_gradient(grad, codec_name=self.NAME).detach().to("cpu", torch.float32)
        numel = flat.numel()
        length, chunks, universe, kept = self._sizes(numel)
        if chunks * length != numel:
            flat = torch.nn.functional.pad(flat, (0, chunks * length - numel))
        parts = torch.view_as_real(torch.fft.rfft(flat.view(chunks, length)))  # (C, B, 2)
        score = _bin_score(parts, length)  # (T,)
        if not math.isfinite(float(score.max())):
            return self._nan_payload(numel)
        mask, indices = select_bins(score, kept, self.select, period=length // 2 + 1)
        values = parts.reshape(universe, 2).index_select(0, indices)  # (k, 2), in index order
        if self.bits == 32:
            header = RangeFloatHeader(max_abs=float(values.abs().max()), exp_bits=0)
            value_bytes = values.reshape(-1).view(torch.uint8)
        else:
            # Range floor: the weakest kept bin's larger part is >= |X| / sqrt(2).
            floor = math.sqrt(float(score.index_select(0, indices).min()) / 2.0)
            codes, header = quantize(values.reshape(-1), self.bits, threshold=floor)
            value_bytes = write_codes(codes, self.bits)
        if self.index_kind(numel) == "bitmap":
            index_code = encode_bitmap(mask)
        else:
            index_code = encode_gap(indices, universe)
        return Payload(torch.cat([header.to_bytes(), index_code, value_bytes]), numel)

    def _nan_payload(self, numel: int) -> Payload:
        data = torch.zeros(self.payload_bytes(numel), dtype=torch.uint8)
        data[:HEADER_BYTES] = RangeFloatHeader(max_abs=math.nan, exp_bits=0).to_bytes()
        return Payload(data, numel)

    def _unpack(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(bin indices (k,), values (k, 2))`` or None for a non-finite payload."""
        numel = payload.numel
        data = payload.data
        expected = self.payload_bytes(numel)
        if data.dtype != torch.uint8 or data.numel() != expected:
            raise ConfigError(
                f"{self.NAME}: payload has {data.numel()} {data.dtype} elements, expected "
                f"{expected} uint8 for numel={numel}; was it made by {self.spec}?"
            )
        header = RangeFloatHeader.from_bytes(data[:HEADER_BYTES])
        if math.isnan(header.max_abs):
            return None
        _, _, universe, kept = self._sizes(numel)
        start = HEADER_BYTES
        kind = self.index_kind(numel)
        stop = start + index_bytes(kind, universe, kept)
        if kind == "bitmap":
            indices = decode_bitmap(data[start:stop], universe).nonzero().reshape(-1)
        else:
            indices = decode_gap(data[start:stop], universe, kept)
        if self.bits == 32:
            values = data[stop:].clone().view(torch.float32)
        else:
            values = dequantize(read_codes(data[stop:], self.bits, 2 * kept), header, self.bits)
        return indices, values.view(kept, 2)

    def _inverse(self, spectrum: torch.Tensor, numel: int) -> torch.Tensor:
        length, chunks, _, _ = self._sizes(numel)
        bins = spectrum.view(chunks, length // 2 + 1, 2)  # (C, B, 2)
        signal = torch.fft.irfft(torch.view_as_complex(bins), n=length)  # (C, L)
        return signal.reshape(-1)[:numel].contiguous()

    def decode(self, payload: Payload) -> torch.Tensor:
        return self.decode_sum([payload])

    def decode_sum(self, payloads: Sequence[Payload]) -> torch.Tensor:
        """Scatter every payload's kept bins into one spectrum, then one inverse FFT."""
        if not payloads:
            raise ConfigError(f"{self.NAME}: decode_sum needs at least one payload")
        numel = payloads[0].numel
        if any(p.numel != numel for p in payloads):
            raise ConfigError(f"{self.NAME}: decode_sum needs payloads of equal numel")
        _, _, universe, _ = self._sizes(numel)
        spectrum = torch.zeros(universe, 2, dtype=torch.float32)  # (T, 2)
        for payload in payloads:
            unpacked = self._unpack(payload)
            if unpacked is None:
                return torch.full((numel,), math.nan, dtype=torch.float32)
            indices, values = unpacked
            spectrum.index_add_(0, indices, values)
        return self._inverse(spectrum, numel)
