"""FFT gradient sparsification with range-float values (HPDC'20's codec).

Wang et al., "FFT-based Gradient Sparsification for the Distributed Training of Deep Neural
Networks", HPDC 2020 (arXiv 1811.08596): transform the flat gradient with a real FFT, drop the
``theta`` fraction of frequency coefficients with the smallest magnitude, quantize the kept
real/imaginary parts with a range-based float (:mod:`superneurons.codecs.coding.rangefloat`) and send
them with a fixed-size index code (:mod:`superneurons.codecs.coding.indexcode`). The paper gives no
code; the pipeline below is our reconstruction.

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
the same speed; ``index="auto"`` picks the smaller. The kept-coefficient coding (selection,
index code, values) is :mod:`superneurons.codecs.coding.sparsecode`, shared with the compactly coded
Top-k and the adaptive codec so that they pay exactly the same coding.

Device: encode, decode and ``decode_sum`` run on the input's (payload's) device with no host
round trip: the range-float header is made of device tensors, the NaN check is a tensor flag,
decoding is dense or a scatter (no ``nonzero``). Only the CPU's ``select="sampled"`` path sizes
tensors from data, which costs nothing there; other devices take ``torch.topk``.

NaN/Inf policy (project-wide): ``encode`` never raises on values. A non-finite input gives a
NaN header scale; such a payload decodes to all-NaN, and ``decode_sum`` over payloads of which
any is non-finite is all-NaN, so a DDP hook propagates it as a dense all-reduce would and
AMP's ``GradScaler`` skips the step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from superneurons.codecs.canonical import Canonical
from superneurons.codecs.codec import Payload, check_gradient, common_numel
from superneurons.codecs.coding.finite import finite_flag
from superneurons.codecs.coding.indexcode import INDEX_KINDS
from superneurons.codecs.coding.rangefloat import check_bits
from superneurons.codecs.coding.sparsecode import (
    SELECTS,
    KeptLayout,
    add_kept,
    kept_count,
    kept_entries,
    pack_kept,
    select_bins,
    select_indices,
)
from superneurons.codecs.coding.streaming import SAMPLE_SIZE
from superneurons.codecs.coding.workspace import workspace
from superneurons.codecs.sparse.blocks import (
    copy_into,
    decode_rows,
    divide_into,
    select_rows,
    subtract_from,
)
from superneurons.errors import ConfigError

__all__ = ["SELECTS", "FFTCodec", "kept_count", "select_bins", "spectrum_layout"]


_CPU = torch.device("cpu")


def spectrum_layout(numel: int, chunk: int) -> tuple[int, int]:
    """``(length L, chunks C)`` of the chunked transform of ``numel`` elements."""
    length = numel if chunk == 0 else min(chunk, numel)
    return length, -(-numel // length)


def _bin_score(parts: torch.Tensor, length: int) -> torch.Tensor:
    """Per-bin ranking score ``w * |X|**2 / 2``; ``parts`` is ``(C, B, 2)``, result ``(C * B,)``
    in a kept CPU buffer (:mod:`superneurons.codecs.coding.workspace`; encode-internal).

    Halving the two unpaired bins (0 and, for even ``L``, ``L / 2``) instead of doubling the
    others gives the same order at a fraction of the cost. ``score <= |X|**2`` everywhere.
    """
    count, bins, _ = parts.shape
    squares = workspace("fft.squares", (count, bins, 2), torch.float32, parts.device)
    squares = torch.view_as_complex(torch.mul(parts, parts, out=squares))  # re**2 + 1j * im**2
    # NOTE: re**2 + im**2 as two rounded products and one rounded sum, exactly as before (an
    # addcmul may fuse and round differently; square().sum(-1) is ~9x slower here).
    by_chunk = workspace("fft.score", (count, bins), torch.float32, parts.device)
    torch.add(squares.real, squares.imag, out=by_chunk)  # (C, B)
    by_chunk[:, 0] *= 0.5
    if length % 2 == 0 and length > 1:
        by_chunk[:, length // 2] *= 0.5
    return by_chunk.reshape(-1)


@dataclass(frozen=True)
class FFTCodec(Canonical):
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

    def _layout(self, numel: int) -> KeptLayout:
        if numel <= 0:
            raise ConfigError(f"{self.NAME}: numel must be positive, got {numel}")
        length, chunks = spectrum_layout(numel, self.chunk)
        universe = chunks * (length // 2 + 1)
        kept = kept_count(universe, self.theta)
        return KeptLayout(universe, kept, width=2, bits=self.bits, index=self.index)

    def index_kind(self, numel: int) -> str:
        """The index code used for a bucket of ``numel`` elements ("bitmap" or "gap")."""
        return self._layout(numel).index_kind

    @property
    def summable(self) -> bool:
        return False

    def payload_bytes(self, numel: int) -> int:
        return self._layout(numel).nbytes

    def encode(self, grad: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        del generator  # deterministic: selection is exact, rounding is to nearest
        flat = check_gradient(grad, codec_name=self.NAME).detach().to(torch.float32)
        numel = flat.numel()
        layout = self._layout(numel)
        length, chunks = spectrum_layout(numel, self.chunk)
        chosen = None
        if self._blocked(flat.device, layout):
            # NOTE: one pass over blocks of rows (blocks.py): the same kept bins, no spectrum-
            # sized tensor; the two-pass path below remains for a missed sample.
            chosen = select_rows(flat, length, chunks, layout.kept)
        if chosen is not None:
            indices, values, kept_score, all_finite = chosen
            finite = torch.tensor(all_finite)
        else:
            if chunks * length != numel:
                flat = torch.nn.functional.pad(flat, (0, chunks * length - numel))
            bins = torch.fft.rfft(flat.view(chunks, length))  # (C, B) complex
            score = _bin_score(torch.view_as_real(bins), length)  # (T,)
            indices = select_indices(score, layout.kept, self.select, period=length // 2 + 1)
            # (k, 2): a gather of complex elements, ~2x cheaper than of (re, im) rows; same bits
            values = torch.view_as_real(bins.reshape(-1).index_select(0, indices))
            kept_score = score.index_select(0, indices)
            finite = finite_flag(score)
        # Range floor: the weakest kept bin's larger part is >= |X| / sqrt(2).
        floor = (kept_score.min() * 0.5).sqrt()
        data = pack_kept(values, None, indices, floor, finite, layout)
        return Payload(data, numel)

    def _blocked(self, device: torch.device, layout: KeptLayout) -> bool:
        """The CPU's one-pass paths (``blocks.py``): chunked, sampled, large enough to sample."""
        return (
            device.type == "cpu"
            and self.chunk > 0
            and self.select == "sampled"
            and layout.universe > 4 * SAMPLE_SIZE
            and layout.kept < layout.universe
        )

    def _check(self, payload: Payload, layout: KeptLayout) -> torch.Tensor:
        data = payload.data
        if data.dtype != torch.uint8 or data.numel() != layout.nbytes:
            raise ConfigError(
                f"{self.NAME}: payload has {data.numel()} {data.dtype} elements, expected "
                f"{layout.nbytes} uint8 for numel={payload.numel}; was it made by {self.spec}?"
            )
        return data

    def _entries(self, payloads: Sequence[Payload], layout: KeptLayout) -> list | None:
        """Every payload's ``(indices, complex64 values)`` for the blocked decode (CPU, chunked),
        or None (a non-finite payload, another device: the dense decode)."""
        if payloads[0].data.device.type != "cpu" or self.chunk == 0:
            return None
        parts = []
        for number, payload in enumerate(payloads):
            # the values in a kept buffer per payload (the parts live together; decode-internal)
            kept = workspace(f"fft.entries.{number}", (2 * layout.kept,), torch.float32, _CPU)
            indices, values, finite = kept_entries(
                self._check(payload, layout), layout, values_out=kept
            )
            if not bool(finite):
                return None
            parts.append((indices, torch.view_as_complex(values.contiguous())))
        return parts

    def decode(self, payload: Payload) -> torch.Tensor:
        return self.decode_sum([payload])

    def decode_sum(self, payloads: Sequence[Payload]) -> torch.Tensor:
        """Add every payload's kept bins into one spectrum, then one inverse FFT."""
        numel = common_numel(payloads, codec_name=self.NAME)
        layout = self._layout(numel)
        parts = self._entries(payloads, layout)
        if parts is not None:
            out = torch.empty(numel)
            decode_rows(parts, numel, self._length(numel), copy_into(out))
            return out
        device = payloads[0].data.device
        # (T, 2), a kept CPU buffer: irfft below writes the (fresh) signal elsewhere
        spectrum = workspace("fft.spectrum", (layout.universe, 2), torch.float32, device).zero_()
        finite = torch.ones((), dtype=torch.bool, device=device)
        for payload in payloads:
            finite = finite & add_kept(spectrum, self._check(payload, layout), layout)
        length, chunks = spectrum_layout(numel, self.chunk)
        bins = torch.view_as_complex(spectrum.view(chunks, length // 2 + 1, 2))  # (C, B)
        signal = torch.fft.irfft(bins, n=length).reshape(-1)[:numel]  # (n,), a fresh tensor
        return signal.add_(torch.where(finite, 0.0, math.nan))  # in place: all-NaN unless finite

    def decode_sum_into(
        self, payloads: Sequence[Payload], out: torch.Tensor, *, divisor: int = 1
    ) -> torch.Tensor:
        """``decode_sum(payloads) / divisor`` into float32 ``out``, bitwise, block by block
        (CPU, finite payloads; otherwise the plain composition)."""
        numel = common_numel(payloads, codec_name=self.NAME)
        parts = self._entries(payloads, self._layout(numel))
        if parts is None:
            return torch.div(self.decode_sum(payloads), divisor, out=out)
        decode_rows(parts, numel, self._length(numel), divide_into(out, divisor))
        return out

    def subtract_decode_(self, payload: Payload, target: torch.Tensor) -> torch.Tensor:
        """``target -= decode(payload)`` block by block (CPU, finite), bitwise."""
        parts = self._entries([payload], self._layout(payload.numel))
        if parts is None:
            return torch.sub(target, self.decode(payload), out=target)
        decode_rows(parts, payload.numel, self._length(payload.numel), subtract_from(target))
        return target

    def _length(self, numel: int) -> int:
        return spectrum_layout(numel, self.chunk)[0]
