"""The FFT codec's CPU pipeline in cache-sized blocks of chunks (rows): one pass each way.

Encoding a chunked gradient of ``C`` rows of length ``L`` used to take the whole spectrum
(``T = C * (L/2 + 1)`` complex bins, as large as the gradient), its weighted power, a sample of
it, a compare over all of it, and a gather: five passes over gradient-sized tensors, and at 30M
values a fresh 240 MB spectrum per call (0.15 GB/s measured). Here each block of rows is
transformed, scored and compared while it is in cache, and only its candidates (positions,
scores, values; ~``k`` in all) leave it.

The threshold must be known before the pass, so it comes from a sample of whole rows
transformed first (evenly spaced, at most :data:`SAMPLE_ROWS`): the quantile that leaves ``k``
bins, widened by three standard errors estimated from how much the rows disagree (a cluster
sample: the bins of one chunk share its scale, so rows, not bins, are the independent units).
The kept set is then ranked exactly among the candidates (:func:`~superneurons.codecs.coding.
streaming.keep_exactly`): the ``k`` bins of largest weighted power, the same set as exact
selection (ties aside), so the payload bytes equal the two-pass path's. When the sample misses
(too few or too many candidates) the caller takes that path.

Decoding is blocked the same way: each block's spectrum is zeroed, receives its kept bins from
every payload, is inverted and written (divided, or subtracted from a residual) while in cache.
``torch.fft`` transforms each row on its own: a block of rows gives the bits of the whole
(checked: rfft/irfft of any row range equal the rows of the full transform).
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from superneurons.codecs.coding import native
from superneurons.codecs.coding.streaming import (
    BLOCK_NUMEL,
    Candidates,
    keep_mask,
    kth_smallest,
)
from superneurons.codecs.coding.workspace import workspace

__all__ = [
    "SAMPLE_ROWS",
    "copy_into",
    "decode_rows",
    "divide_into",
    "select_rows",
    "subtract_from",
]

SAMPLE_ROWS = 256  # rows transformed to place the threshold (~64k bins at L = 512)
_MARGIN_SIGMAS = 3.0
# NOTE: rows per block: ~256k values (1 MiB in, ~2 MiB of spectrum: L2 and L3). On the 2-core
# AMD EPYC, with the candidate kernel (one thread, the two sizes alternated in one process,
# medians): encode 1.11 against 1.06 GB/s at 6.5M values and 1.03 against 1.01 at 30M; the
# decode of two payloads plus a residual's 41.4 against 44.8 ms at 6.5M and 160 against 176 ms
# at 30M (fewer per-block calls); at 1M the same. Blocks of 512k values lost at 1M.
_BLOCK_VALUES = BLOCK_NUMEL

Entries = tuple[torch.Tensor, torch.Tensor]  # (k,) increasing bin indices, (k,) complex64 values


def _rows_per_block(length: int) -> int:
    return max(1, _BLOCK_VALUES // length)


def _score_rows(bins: torch.Tensor, length: int, squares: np.ndarray, out: np.ndarray) -> None:
    """``w * |X|**2 / 2`` of complex ``bins`` ``(R, B)`` into ``out`` ``(R, B)`` float32 (the
    two unpaired bins halved: the same order as ``w * |X|**2``), as ``fft._bin_score`` makes
    it: two rounded products and one rounded sum."""
    parts = torch.view_as_real(bins).numpy()  # (R, B, 2)
    np.multiply(parts, parts, out=squares)
    np.add(squares[..., 0], squares[..., 1], out=out)
    out[:, 0] *= 0.5
    if length % 2 == 0 and length > 1:
        out[:, length // 2] *= 0.5


def _rows(flat: torch.Tensor, length: int, chunks: int) -> Callable[[int, int], torch.Tensor]:
    """``rows(a, b)``: rows ``a..b-1`` of the zero-padded ``(chunks, length)`` view of
    ``flat`` (a view, except for the padded last row, which is copied)."""
    numel = flat.numel()
    full = numel // length
    body = flat[: full * length].view(full, length)

    def rows(start: int, stop: int) -> torch.Tensor:
        if stop <= full:
            return body[start:stop]
        block = torch.zeros(stop - start, length)
        block[: full - start] = body[start:]
        block[full - start, : numel - full * length] = flat[full * length :]
        return block

    return rows


def _bracket(
    rows: Callable[[int, int], torch.Tensor], length: int, chunks: int, count: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """``(low, high)`` around the ``count``-th largest of ``chunks * bins`` scores, from the
    scores of evenly spaced rows; None when there are too few rows to sample."""
    bins = length // 2 + 1
    full = chunks - 1  # evenly spaced among the rows that need no padding
    taken = min(SAMPLE_ROWS, full // 4)
    if taken < 16:
        return None
    picks = torch.arange(taken).mul_(2).add_(1).mul_(full).div_(2 * taken, rounding_mode="floor")
    sample_rows = rows(0, full).index_select(0, picks)  # (S, L)
    scores = np.empty((taken, bins), dtype=np.float32)
    squares = np.empty((taken, bins, 2), dtype=np.float32)
    _score_rows(torch.fft.rfft(sample_rows), length, squares, scores)
    flat = torch.from_numpy(scores.reshape(-1))
    size = flat.numel()
    drop_share = 1.0 - count / (chunks * bins)
    (middle,) = kth_smallest(flat, min(size, max(1, round(size * drop_share))))
    share_above = (scores >= middle.numpy()).mean(axis=1)  # (S,): each row's share above
    # The variance of a cluster sample's share: that of the rows' shares over their number,
    # at least the binomial one of independent bins.
    variance = max(float(share_above.var()) / taken, drop_share * (1 - drop_share) / size)
    margin = _MARGIN_SIGMAS * math.sqrt(variance)
    low_rank = max(1, math.floor(size * (drop_share - margin)))
    high_rank = min(size, math.ceil(size * (drop_share + margin)))
    low, high = kth_smallest(flat, low_rank, high_rank)
    return low.numpy(), high.numpy()


def select_rows(
    flat: torch.Tensor, length: int, chunks: int, count: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool] | None:
    """The ``count`` bins of largest weighted power of CPU float32 ``flat``'s chunked rFFT in
    one blocked pass: ``(indices (k,) increasing, values (k, 2) float32, kept scores (k,),
    finite)`` (``finite``: every score is). None when the rows sampled missed the threshold
    or are too few: the caller takes the two-pass path."""
    rows = _rows(flat, length, chunks)
    limits = _bracket(rows, length, chunks, count)
    if limits is None:
        return None
    low, high = limits
    library = native.spectrum_kernels()
    scan = _scan_numpy if library is None else functools.partial(_scan_native, library)
    found = scan(rows, length, chunks, low, 2 * count + 4096)
    if found is None:
        return None
    positions, kept_scores, values = found
    candidates = Candidates(positions, kept_scores, 0.0)
    peak = float(kept_scores.max()) if kept_scores.size else 0.0  # NaN propagates
    keep = keep_mask(candidates, count, high)
    if keep is None:
        return None
    return (
        torch.from_numpy(positions[keep]),
        torch.view_as_real(_kept_values(values, keep, count)),
        torch.from_numpy(kept_scores[keep]),
        math.isfinite(peak),
    )


Scan = tuple[np.ndarray, np.ndarray, list[np.ndarray]]  # positions, scores, values in pieces


def _scan_numpy(
    rows: Callable[[int, int], torch.Tensor], length: int, chunks: int, low: np.ndarray, limit: int
) -> Scan | None:
    """Every bin whose score is not below ``low`` (NaN included), block by block: positions,
    scores and complex64 values (one piece per block); None past ``limit`` candidates."""
    bins = length // 2 + 1
    per = _rows_per_block(length)
    squares = np.empty((per, bins, 2), dtype=np.float32)
    scores = np.empty((per, bins), dtype=np.float32)
    mask = np.empty(per * bins, dtype=np.bool_)
    positions, kept_scores, values = [], [], []
    found = 0
    for start in range(0, chunks, per):
        stop = min(chunks, start + per)
        size = (stop - start) * bins
        block = torch.fft.rfft(rows(start, stop))  # (R, B); NOTE: out= would add a copy
        part = scores[: stop - start]
        _score_rows(block, length, squares[: stop - start], part)
        hits = mask[:size]
        np.logical_not(np.less(part.reshape(-1), low, out=hits), out=hits)
        local = np.flatnonzero(hits)
        found += local.size
        if found > limit:
            return None
        kept_scores.append(part.reshape(-1)[local])
        values.append(block.reshape(-1).numpy()[local])  # complex64, copied by the index
        positions.append(local + start * bins)
    return np.concatenate(positions), np.concatenate(kept_scores), values


def _scan_native(
    library: ctypes.CDLL,
    rows: Callable[[int, int], torch.Tensor],
    length: int,
    chunks: int,
    low: np.ndarray,
    limit: int,
) -> Scan | None:
    """:func:`_scan_numpy`'s candidates, the same bits, each block's scoring, comparison and
    gathers in one loop of the kernel (``spectrum.c``) while the block is in cache."""
    bins = length // 2 + 1
    per = _rows_per_block(length)
    cpu = torch.device("cpu")
    # room for the candidates (~k; kept buffers: no page faults per call up to 64 MiB each)
    positions = workspace("fft.candidate_positions", (limit + 1,), torch.int64, cpu)
    scores = workspace("fft.candidate_scores", (limit + 1,), torch.float32, cpu)
    values = workspace("fft.candidate_values", (limit + 1,), torch.complex64, cpu)
    found = 0
    for start in range(0, chunks, per):
        stop = min(chunks, start + per)
        block = torch.fft.rfft(rows(start, stop))  # (R, B); NOTE: out= would add a copy
        found += native.spectrum_candidates_into(
            library, block, length=length, low=float(low), base=start * bins,
            positions=positions[found:], scores=scores[found:], values=values[found:],
        )  # fmt: skip
        if found > limit:
            return None
    return positions[:found].numpy(), scores[:found].numpy(), [values[:found].numpy()]


def _kept_values(values: list[np.ndarray], keep: np.ndarray, count: int) -> torch.Tensor:
    """The kept of every block's candidate values, in order, ``(count,)`` complex64: each
    block's share written straight into the result (no concatenation of all candidates
    first: one copy of ~k values fewer)."""
    out = np.empty(count, dtype=np.complex64)
    start = taken = 0
    for part in values:
        mask = keep[start : start + part.size]
        size = int(np.count_nonzero(mask))
        np.compress(mask, part, out=out[taken : taken + size])
        start, taken = start + part.size, taken + size
    return torch.from_numpy(out)


Write = Callable[[torch.Tensor, slice], None]  # a block's signal (before + 0), its outputs


def decode_rows(parts: Sequence[Entries], numel: int, length: int, write: Write) -> None:
    """The inverse transform of the summed kept bins of ``parts`` (each ``(indices, complex64
    values)``), block by block: ``write(signal, where)`` gets each block's signal (the rows'
    values, padding cut; the ``+ 0.0`` that the dense decode's finite flag applies still to
    come: :func:`copy_into`, :func:`divide_into`, :func:`subtract_from`) and
    the slice of the ``numel`` outputs it covers. Sums in payload order, as ``index_add_`` into
    one spectrum does (the kernel, ``spectrum.c``, adds in the same order)."""
    bins = length // 2 + 1
    chunks = -(-numel // length)
    per = _rows_per_block(length)
    starts = np.arange(0, chunks + per, per) * bins
    cuts = [np.searchsorted(indices.numpy(), starts) for indices, _ in parts]
    cpu = torch.device("cpu")
    spectrum = workspace("fft.decode_spectrum", (per * bins,), torch.complex64, cpu)
    library = native.spectrum_kernels()
    for block, start in enumerate(range(0, chunks, per)):
        stop = min(chunks, start + per)
        here = spectrum[: (stop - start) * bins].zero_()
        for (indices, values), cut in zip(parts, cuts, strict=True):
            lo, hi = int(cut[block]), int(cut[block + 1])
            if hi <= lo:
                continue
            if library is None:
                here.index_add_(0, indices[lo:hi] - start * bins, values[lo:hi])
            else:
                native.add_bins_into(library, here, base=start * bins, indices=indices[lo:hi],
                                     values=values[lo:hi])  # fmt: skip
        # NOTE: a fresh result: irfft's out= computes elsewhere and copies (~20% of its time)
        rows = torch.fft.irfft(here.view(stop - start, bins), n=length)
        first, last = start * length, min(numel, stop * length)
        write(rows.reshape(-1)[: last - first], slice(first, last))


def copy_into(out: torch.Tensor) -> Write:
    """A :func:`decode_rows` writer: ``out[where] = signal + 0``."""

    def copy(signal: torch.Tensor, where: slice) -> None:
        out[where].copy_(signal.add_(0.0))

    return copy


def divide_into(out: torch.Tensor, divisor: int) -> Write:
    """A :func:`decode_rows` writer: ``out[where] = (signal + 0) / divisor`` (one pass in the
    kernel, the bits of torch's ``add_`` then ``div``)."""
    library = native.spectrum_kernels()

    def divide(signal: torch.Tensor, where: slice) -> None:
        if library is None:
            torch.div(signal.add_(0.0), divisor, out=out[where])
        else:
            native.signal_divide_into(library, signal, float(divisor), out=out[where])

    return divide


def subtract_from(target: torch.Tensor) -> Write:
    """A :func:`decode_rows` writer: ``target[where] -= signal + 0`` (one pass in the kernel,
    the bits of torch's ``add_`` then ``sub``)."""
    library = native.spectrum_kernels()

    def subtract(signal: torch.Tensor, where: slice) -> None:
        piece = target[where]
        if library is None:
            torch.sub(piece, signal.add_(0.0), out=piece)
        else:
            native.signal_subtract_from(library, signal, target=piece)

    return subtract
