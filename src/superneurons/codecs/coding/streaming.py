"""The k largest scores of a gradient in one pass over cache-sized blocks (CPU).

A sparsifier keeps exactly ``k`` of ``T`` coefficients. :mod:`.sparsecode`'s sampled selection
brackets the k-th largest score between two quantiles of a strided sample (``low``, ``high``),
keeps every score above ``high`` and ranks only the band between them: the same kept set as
``torch.topk`` (ties aside). It needs the score of every coefficient, which the codecs used to
write to a full-size buffer (and the input's square or magnitude to another), then scan again:
three to five passes over memory for what is one pass of arithmetic.

Here the score is made block by block (:data:`BLOCK_NUMEL` values, so the block and its score
stay in the core's L2 cache) and compared at once: what leaves a block is its candidates
(positions, scores; ~``k`` in all), never a full-size array. The brackets come from the same
strided sample as before, so the kept set, and every payload byte, equal the two-pass
selection's, ties included (:func:`keep_exactly` is the one rule both use).

Numpy runs the per-block arithmetic (one ufunc call costs ~1 us against torch's ~5 us, which
matters at ~100 blocks per bucket) on views of the tensors' memory; IEEE products and
comparisons are the same bits in either library. CPU only: other devices take ``torch.topk``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from superneurons.codecs.coding.finite import finite_flag
from superneurons.codecs.coding.workspace import workspace

__all__ = [
    "BLOCK_NUMEL",
    "SPATIAL_PERIOD",
    "Bracket",
    "Candidates",
    "bracket",
    "keep_exactly",
    "keep_mask",
    "kth_smallest",
    "sample_stride",
    "scan",
    "select_streaming",
]

# NOTE: 2**18 fp32 values (1 MiB; the block and its score sit in L2/L3): on the 2-core AMD EPYC
# this was tuned on, 2**16 paid the per-block numpy calls (~10% slower at 6.5M values) and
# 2**20 spilled to L3 (up to 20% slower); a 25 MiB bucket is 25 blocks.
BLOCK_NUMEL = 1 << 18
SAMPLE_SIZE = 16384  # scores sampled (strided) to bracket the threshold
# NOTE: the strided sample of a spatial gradient avoids strides with a factor 2, 3, 5 or 7:
# a weight's rows are usually such multiples (4096, 768, 3 * 3 * 64), and a stride sharing
# them samples a few columns only; on an MLP's fc weight (stride 512, rows of 4096) the
# bracket then missed and the exact top-k of 8.4M scores took 240 ms.
SPATIAL_PERIOD = 2 * 3 * 5 * 7
# NOTE: the sampled quantiles are widened by this many binomial standard errors. At 3 (as
# before) a DDP hook's error-feedback step on a 6.5M bucket missed 1 of 10 (the exact fallback:
# a full topk, ~200 ms); at 4 the band holds ~1/3 more candidates (~0.1% of the values) and
# misses are ~50x rarer (binomial tails). The kept set is the same either way.
_MARGIN_SIGMAS = 4.0


@dataclass(frozen=True)
class Bracket:
    """Two scores around the k-th largest: every kept score is ``>= low``; every score ``>
    high`` is kept (unless the sample erred: then :func:`keep_exactly` says so)."""

    low: np.ndarray  # 0-d float32
    high: np.ndarray  # 0-d float32


@dataclass(frozen=True)
class Candidates:
    """The scores ``>= low`` of a scan, in increasing position, and the largest score seen
    (NaN when any score was NaN: the caller's finiteness check)."""

    positions: np.ndarray  # (c,) int64, increasing
    scores: np.ndarray  # (c,) float32
    peak: float


def kth_smallest(values: torch.Tensor, *ranks: int) -> tuple[torch.Tensor, ...]:
    """0-d ``torch.kthvalue(values, rank).values`` of a 1-D tensor for each ``rank`` (NaN
    ranks above every number, as there). NOTE: on the CPU ``numpy.partition``: 0.07 against
    0.5-1.0 ms for one rank of 65,536 (the adaptive codec's Lagrangian threshold; one thread),
    the same values (of a tie of -0 and +0 either zero may come back: the codecs rank squares,
    never -0); other devices keep ``kthvalue``. Several ranks are found one after another,
    each among the values above the previous one (where a partition leaves them): numpy's own
    multi-rank ``partition`` took 0.81 ms for two ranks of 65,792 scores, this 0.12 ms."""
    if values.device.type != "cpu":
        return tuple(torch.kthvalue(values, rank).values for rank in ranks)
    rest = values.detach().contiguous().numpy()
    below = 0  # values of the full array that lie before `rest`
    found: dict[int, np.ndarray] = {}
    for rank in sorted(set(ranks)):
        rest = np.partition(rest, rank - 1 - below)
        found[rank] = rest[rank - 1 - below : rank - below]
        rest, below = rest[rank - below :], rank
    return tuple(torch.from_numpy(found[rank].copy()).reshape(()) for rank in ranks)


def sample_stride(universe: int, period: int = 1) -> int:
    """A stride giving ~``SAMPLE_SIZE`` samples that is coprime with ``period`` (coefficients
    per chunk), so a strided sample visits every frequency of the chunks instead of aliasing."""
    stride = max(1, universe // SAMPLE_SIZE)
    while math.gcd(stride, period) != 1:
        stride += 1
    return stride


def bracket(sample: torch.Tensor, universe: int, count: int) -> Bracket:
    """The quantiles of ``sample`` (scores, CPU) that bracket the ``count``-th largest of
    ``universe`` scores: the drop share ± ``_MARGIN_SIGMAS`` binomial standard errors."""
    size = sample.numel()
    drop_share = 1.0 - count / universe
    margin = _MARGIN_SIGMAS * math.sqrt(drop_share * (1 - drop_share) / size)
    low_rank = max(1, math.floor(size * (drop_share - margin)))
    high_rank = min(size, math.ceil(size * (drop_share + margin)))
    low, high = kth_smallest(sample, low_rank, high_rank)
    return Bracket(low.numpy(), high.numpy())


def keep_exactly(candidates: Candidates, count: int, high: np.ndarray) -> np.ndarray | None:
    """The increasing positions of exactly ``count`` largest scores among ``candidates``
    (:func:`keep_mask`'s), or None when the bracket missed."""
    keep = keep_mask(candidates, count, high)
    return None if keep is None else candidates.positions[keep]


def keep_mask(candidates: Candidates, count: int, high: np.ndarray) -> np.ndarray | None:
    """Which of ``candidates`` are the ``count`` largest scores: all above ``high``, then the
    largest of the band below it (``torch.topk``, as the exact path ranks). None when the
    bracket missed (fewer than ``count`` candidates, or more than ``count`` above ``high``):
    the caller falls back to exact selection."""
    scores = candidates.scores
    keep = scores > high  # (c,): surely among the top `count`
    missing = count - int(np.count_nonzero(keep))
    band = np.flatnonzero(~keep)  # (b,): positions in `candidates` to rank
    if not 0 <= missing <= band.size:
        return None
    if missing:
        band_scores = torch.from_numpy(scores).index_select(0, torch.from_numpy(band))
        ranked = torch.topk(band_scores, missing, sorted=False).indices.numpy()
        keep[band[ranked]] = True
    return keep


def scan(values: np.ndarray, low: np.ndarray, *, score: str, limit: int) -> Candidates | None:
    """One pass over 1-D float32 ``values`` in blocks: the positions and scores not below
    ``low`` (``>= low``, and NaN), ``score`` being ``"square"`` (``v * v``) or ``"abs"``
    (``|v|``). None once more than ``limit`` candidates turn up (the bracket was far too low,
    e.g. a gradient of ties): the caller falls back to exact selection rather than hold a
    full-size candidate list.

    NOTE: a NaN score is "not below" any ``low``, so it is a candidate and ``peak`` sees it:
    the finiteness flag costs no pass of its own."""
    numel = values.size
    block = min(BLOCK_NUMEL, numel)
    score_buf = np.empty(block, dtype=np.float32)
    mask_buf = np.empty(block, dtype=np.bool_)
    positions: list[np.ndarray] = []
    scores: list[np.ndarray] = []
    found = 0
    for start in range(0, numel, block):
        chunk = values[start : start + block]
        part, mask = score_buf[: chunk.size], mask_buf[: chunk.size]
        if score == "square":
            np.multiply(chunk, chunk, out=part)
        else:
            np.abs(chunk, out=part)
        np.logical_not(np.less(part, low, out=mask), out=mask)
        local = np.flatnonzero(mask)
        found += local.size
        if found > limit:
            return None
        scores.append(part[local])
        local += start
        positions.append(local)
    kept_scores = np.concatenate(scores)
    peak = float(kept_scores.max()) if kept_scores.size else 0.0  # NaN propagates
    return Candidates(np.concatenate(positions), kept_scores, peak)


def select_streaming(
    flat: torch.Tensor, count: int, *, score: str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The increasing indices of exactly the ``count`` largest ``score``s of CPU float32
    ``flat`` (``"square"``: ``v * v``; ``"abs"``: ``|v|``) in one blocked pass, and a 0-d bool
    "every value is finite". The bracket comes from the strided sample that the two-pass
    :func:`~.sparsecode.select_indices` takes with ``period=SPATIAL_PERIOD``, so the kept set
    is the same. When the sample missed, the exact ``torch.topk`` (what the two-pass path
    falls back to). None when the candidates overflow ``2 (k + margin)`` (ties around the
    threshold, e.g. a mostly-zero gradient): the caller takes the two-pass path, whose
    band ranking breaks those ties as before (and small inputs, which it ranks whole)."""
    universe = flat.numel()
    if count >= universe or universe <= 4 * SAMPLE_SIZE:
        return None  # small: the two-pass path ranks everything, as it always did
    values = flat.detach().contiguous().numpy()
    sample = flat[:: sample_stride(universe, SPATIAL_PERIOD)].contiguous()  # (s,)
    sample = torch.mul(sample, sample) if score == "square" else sample.abs()
    limits = bracket(sample, universe, count)
    drop_share = 1.0 - count / universe
    margin = _MARGIN_SIGMAS * math.sqrt(drop_share * (1 - drop_share) / sample.numel())
    limit = 2 * (count + math.ceil(margin * universe)) + 1024
    candidates = scan(values, limits.low, score=score, limit=limit)
    if candidates is None:
        return None
    kept = keep_exactly(candidates, count, limits.high)
    if kept is None:  # the sample missed: rank everything (what the two-pass path does next)
        full = workspace("streaming.score", (universe,), torch.float32, flat.device)
        full = torch.mul(flat, flat, out=full) if score == "square" else torch.abs(flat, out=full)
        indices = torch.sort(torch.topk(full, count, sorted=False).indices).values
    else:
        indices = torch.from_numpy(kept)
    if math.isfinite(candidates.peak):
        finite = torch.ones((), dtype=torch.bool)
    else:  # NaN/inf, or a square that overflowed: decide on the values themselves
        finite = finite_flag(flat)
    return indices, finite
