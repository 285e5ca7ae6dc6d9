"""The coding of a sparse message's kept coefficients, shared so codecs compete on equal terms.

A sparsifying codec (``fft``, compactly coded ``ctopk``, ``adaptive``) keeps exactly ``k`` of
``T`` coefficients (each ``width`` floats: 2 for complex FFT bins, 1 for real coefficients) and
sends them in one fixed-size layout::

    [range-float header, 8 B][index code: bitmap or Elias-Fano][k * width values at ``bits``]

so bits per element compare transforms, not coding (a Top-k paying 64 bits per kept element
against FFT's 8-bit values and compact index decides nothing: benchmarks/results/codecs/README.md). The index code
is :mod:`superneurons.codecs.coding.indexcode`'s bitmap or Elias-Fano gap code, whichever is smaller
for ``(T, k)`` when ``index="auto"``; values are range-floats
(:mod:`superneurons.codecs.rangefloat`) with the window from the largest kept part down to the
weakest kept coefficient (HPDC'20's ``[threshold, max]`` rule); ``bits = 32`` sends raw float32.

Device: everything runs on the coefficients' device with no host round trip. Selection is
``torch.topk`` (then a sort for index order) except on the CPU with ``select="sampled"``, where
a sampled threshold (in the spirit of DGC, Lin et al., ICLR 2018) brackets the k-th largest
score and only a narrow band is ranked exactly: the same kept set (ties aside) at a fraction of
the cost. That path sizes tensors from the data, which is free on the CPU (no device to wait
for) and would synchronise a GPU, so other devices always take ``torch.topk``. Decoding a
bitmap is dense (a rank by ``cumsum`` and a gather), decoding Elias-Fano a scatter: neither
needs ``nonzero``, whose output size would have to come back to the host.

CPU speed: on the CPU the scans run through numpy views of the same
memory (compare + ``flatnonzero``, ``partition``, ``packbits``/``unpackbits``: 3-10x faster than
the torch ops on one thread, same results, tested) and encode-internal temporaries come from
:mod:`superneurons.codecs.coding.workspace` (no page faults per call); other devices are unchanged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from superneurons.codecs.coding.bitpack import packed_bytes
from superneurons.codecs.coding.indexcode import (
    INDEX_KINDS,
    bitmap_positions,
    decode_bitmap,
    decode_gap,
    encode_bitmap,
    encode_gap,
    flat_nonzero,
    index_bytes,
    set_positions,
)
from superneurons.codecs.coding.rangefloat import (
    HEADER_BYTES,
    RangeFloatHeader,
    quantize,
    read_values,
    write_codes,
)
from superneurons.codecs.coding.streaming import (
    BLOCK_NUMEL,
    SAMPLE_SIZE,
    Candidates,
    bracket,
    keep_exactly,
    kth_smallest,
    sample_stride,
)
from superneurons.codecs.coding.workspace import workspace
from superneurons.errors import ConfigError

__all__ = [
    "SELECTS",
    "KeptLayout",
    "add_kept",
    "check_select_index",
    "check_theta",
    "kept_count",
    "kept_entries",
    "kth_smallest",
    "pack_kept",
    "scatter_mean_",
    "select_bins",
    "select_indices",
    "subtract_kept_",
]

logger = logging.getLogger("superneurons.compress")

SELECTS: tuple[str, ...] = ("exact", "sampled")


def check_theta(theta: object, *, owner: str) -> float:
    """``theta`` as a float in [0, 1) or a ConfigError that says what it means."""
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ConfigError(f"{owner}: theta must be a number in [0, 1), got {theta!r}")
    if not 0.0 <= theta < 1.0:
        raise ConfigError(
            f"{owner}: theta={theta} is the fraction of coefficients dropped and must be in "
            "[0, 1); e.g. theta=0.9 keeps 10%"
        )
    return float(theta)


def check_select_index(select: str, index: str, *, owner: str) -> None:
    """Validate the shared ``select`` and ``index`` options of the sparse codecs."""
    if select not in SELECTS:
        raise ConfigError(f"{owner}: select={select!r} is unknown; use one of {list(SELECTS)}")
    if index not in (*INDEX_KINDS, "auto"):
        raise ConfigError(
            f"{owner}: index={index!r} is unknown; use one of {[*INDEX_KINDS, 'auto']}"
        )


def kept_count(universe: int, theta: float) -> int:
    """Coefficients kept out of ``universe``: ``T - floor(theta * T)``, at least 1 (fixed,
    data-free). ``floor`` keeps the dropped share ``<= theta`` even when ``theta * T`` rounds
    low."""
    return max(1, universe - math.floor(theta * universe))


@dataclass(frozen=True)
class KeptLayout:
    """Sizes of a kept-coefficient message: ``universe`` coefficients, ``kept`` of them sent,
    ``width`` floats each at ``bits``; ``index`` "bitmap" | "gap" | "auto" (the smaller)."""

    universe: int
    kept: int
    width: int
    bits: int
    index: str = "auto"

    def __post_init__(self) -> None:
        if not 1 <= self.kept <= self.universe:
            raise ConfigError(f"kept={self.kept} must be in 1..universe={self.universe}")
        if self.index not in (*INDEX_KINDS, "auto"):
            raise ConfigError(f"index={self.index!r} is unknown; use bitmap, gap or auto")

    @property
    def index_kind(self) -> str:
        """The index code in use ("bitmap" or "gap"); ties go to the bitmap."""
        if self.index != "auto":
            return self.index
        sizes = {kind: index_bytes(kind, self.universe, self.kept) for kind in INDEX_KINDS}
        return min(INDEX_KINDS, key=lambda kind: (sizes[kind], kind != "bitmap"))

    @property
    def index_bytes(self) -> int:
        return index_bytes(self.index_kind, self.universe, self.kept)

    @property
    def value_bytes(self) -> int:
        count = self.kept * self.width
        return 4 * count if self.bits == 32 else packed_bytes(count, self.bits)

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + self.index_bytes + self.value_bytes


def select_bins(
    score: torch.Tensor, count: int, select: str, *, period: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, indices)`` of exactly ``count`` coefficients with the largest ``score``: a bool
    mask over all of them and the kept indices in increasing order. ``period``: coefficients
    per chunk (the sampled threshold avoids strides that alias with it)."""
    indices = select_indices(score, count, select, period=period)
    return _mask_of(indices, score.numel(), fresh=True), indices


def select_indices(
    score: torch.Tensor, count: int, select: str, *, period: int = 1
) -> torch.Tensor:
    """The increasing indices of exactly ``count`` coefficients with the largest ``score`` (the
    ``indices`` of :func:`select_bins`, without building the mask a gap index never needs)."""
    universe = score.numel()
    device = score.device
    if count >= universe:
        return torch.arange(universe, device=device)
    if select == "sampled" and device.type == "cpu" and universe > 4 * SAMPLE_SIZE:
        chosen = _select_sampled(score, count, period)
        if chosen is not None:
            return chosen
    return torch.sort(torch.topk(score, count, sorted=False).indices).values  # (k,)


def _mask_of(indices: torch.Tensor, universe: int, *, fresh: bool) -> torch.Tensor:
    """The bool mask of ``indices`` over ``universe`` positions (a kept CPU buffer unless
    ``fresh``: then it may be handed to a caller)."""
    if fresh:
        mask = torch.zeros(universe, dtype=torch.bool, device=indices.device)
    else:
        mask = workspace("sparsecode.mask", (universe,), torch.bool, indices.device).zero_()
    return set_positions(mask, indices)


def _select_sampled(score: torch.Tensor, count: int, period: int) -> torch.Tensor | None:
    """CPU only. Two thresholds from one strided sample bracket the count-th largest score:
    scores above the high one are surely kept, those between the two (~2 * margin * T) are
    ranked exactly (:func:`~.streaming.keep_exactly`, the rule the one-pass scan shares).
    Returns the increasing kept indices, or None when the sample erred."""
    universe = score.numel()
    sample = score[:: sample_stride(universe, period)].contiguous()  # (s,)
    limits = bracket(sample, universe, count)
    # (T,) into a kept buffer: a superset of the top `count` unless the sample erred.
    # NOTE: numpy's compare and flatnonzero (this path is CPU-only): 0.32 ms against 1.4 ms
    # for torch.ge + nonzero on 526k scores (one thread); identical positions.
    above = workspace("sparsecode.above", (universe,), torch.bool, score.device)
    flat = score.detach().contiguous().numpy()
    np.greater_equal(flat, limits.low, out=above.numpy())
    positions = flat_nonzero(above).numpy()  # (c,), increasing
    kept = keep_exactly(Candidates(positions, flat[positions], 0.0), count, limits.high)
    if kept is None:
        logger.debug("sampled thresholds missed the %d-th largest; exact fallback", count)
        return None
    return torch.from_numpy(kept)


def pack_kept(
    values: torch.Tensor,
    mask: torch.Tensor | None,
    indices: torch.Tensor,
    floor: torch.Tensor,
    finite: torch.Tensor,
    layout: KeptLayout,
) -> torch.Tensor:
    """The message bytes (``layout.nbytes`` uint8) for kept ``values`` ``(k, width)`` at the
    sorted ``indices`` (``mask`` their bitmap, or None: built here when the bitmap index needs
    it). ``floor``: 0-d, the weakest kept coefficient's magnitude (bottom of the range-float
    window); ``finite``: 0-d bool, False flags non-finite input (the message then decodes to
    all-NaN). Every part is written straight into the one message buffer (no ``cat``)."""
    flat = values.reshape(-1)
    data = torch.empty(layout.nbytes, dtype=torch.uint8, device=values.device)
    start = HEADER_BYTES
    stop = start + layout.index_bytes
    nan_bits = torch.full_like(finite, 0x7FC00000, dtype=torch.int32)
    if layout.bits == 32:
        max_bits = flat.abs().max().reshape(1).view(torch.int32)[0]
        header = RangeFloatHeader(
            torch.where(finite, max_bits, nan_bits), torch.zeros_like(max_bits)
        )
        data[stop:] = flat.contiguous().view(torch.uint8)  # raw float32 bytes
    else:
        # kept codes (int32) for the CPU: no fresh pages per message; copied into `data` below
        scratch = workspace("sparsecode.codes", (flat.numel(),), torch.int32, flat.device)
        codes, header = quantize(flat, layout.bits, threshold=floor, out=scratch)
        header = RangeFloatHeader(torch.where(finite, header.max_bits, nan_bits), header.exp_bits)
        if layout.bits == 8:  # the cast keeps the low byte (two's complement), as write_codes
            data[stop:].copy_(codes)
        else:
            data[stop:] = write_codes(codes, layout.bits)
    data[:start] = header.to_bytes()
    if layout.index_kind == "bitmap":
        if mask is None:
            mask = _mask_of(indices, layout.universe, fresh=False)
        data[start:stop] = encode_bitmap(mask)
    else:
        data[start:stop] = encode_gap(indices, layout.universe)
    return data


def kept_entries(
    data: torch.Tensor, layout: KeptLayout, *, values_out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A message's kept ``(indices (k,) int64 increasing, values (k, width) float32, finite)``
    (``finite``: the header's 0-d bool flag; the values written into ``values_out``, float32
    ``(k * width,)``, when given). Sizes its output from data: CPU callers only (it is what
    :func:`add_kept` scatters; a decode into a caller's buffer uses it directly)."""
    header = RangeFloatHeader.from_bytes(data[:HEADER_BYTES])
    start = HEADER_BYTES
    stop = start + layout.index_bytes
    values = _kept_values(data[stop:], header, layout, out=values_out)
    if layout.index_kind == "bitmap":
        indices = bitmap_positions(data[start:stop], layout.universe)
    else:
        indices = decode_gap(data[start:stop], layout.universe, layout.kept, sync_free=False)
    return indices, values, header.finite


def _kept_values(
    body: torch.Tensor,
    header: RangeFloatHeader,
    layout: KeptLayout,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kept values ``(k, width)`` float32 of a message's value bytes (in ``out`` if given)."""
    count = layout.kept * layout.width
    if layout.bits == 32:
        raw = body[: 4 * count]  # the values' float32 bytes
        if out is None:
            values = raw.clone().view(torch.float32)
        else:
            values = out
            out.view(torch.uint8).copy_(raw)
    else:
        values = read_values(body, header, layout.bits, count, out=out)
    return values.view(layout.kept, layout.width)


def add_kept(
    out: torch.Tensor, data: torch.Tensor, layout: KeptLayout, *, sync_free: bool | None = None
) -> torch.Tensor:
    """Add the message's kept coefficients into ``out`` ``(T, width)`` float32 in place;
    returns the header's 0-d bool "finite" flag (the caller turns False into all-NaN).
    ``sync_free``: take the path without ``nonzero`` (None: on every device but the CPU, where
    ``nonzero`` waits for nothing and is faster)."""
    if sync_free is None:
        sync_free = out.device.type != "cpu"
    header = RangeFloatHeader.from_bytes(data[:HEADER_BYTES])
    start = HEADER_BYTES
    stop = start + layout.index_bytes
    values = _kept_values(data[stop:], header, layout)  # (k, width)
    if layout.index_kind == "bitmap":
        if not sync_free:
            out.index_add_(0, bitmap_positions(data[start:stop], layout.universe), values)
        else:
            mask = decode_bitmap(data[start:stop], layout.universe)  # (T,)
            # Dense, sync-free scatter: the i-th set bit takes the i-th value.
            rank = torch.cumsum(mask, 0, dtype=torch.int32).sub_(1).clamp_(min=0)  # (T,)
            gathered = values.index_select(0, rank)  # (T, width)
            out.addcmul_(gathered, mask.unsqueeze(1).to(out.dtype))
    else:
        indices = decode_gap(data[start:stop], layout.universe, layout.kept, sync_free=sync_free)
        out.index_add_(0, indices, values)
    return header.finite


def scatter_mean_(
    out: torch.Tensor, parts: Sequence[tuple[torch.Tensor, torch.Tensor]], divisor: int
) -> torch.Tensor:
    """``out`` = the sum of every ``(indices, values)`` part scattered into zeros,
    divided by ``divisor``: bitwise the dense ``zeros().index_add_(...) / divisor``. ``out`` is
    ``(T,)`` (width 1: row-wise index ops on ``(T, 1)`` views ran 4-14x slower) or ``(T,
    width)``.

    NOTE: on the CPU, 1-D, in L2-sized blocks: each block is zeroed, receives its parts'
    values and is divided while in cache, so ``out`` is written once. Scattering into the
    whole freshly zeroed tensor missed the cache on every kept value (26 MB, 65k values:
    ~15 ms against ~4 here, one thread)."""
    numel = out.shape[0]
    increasing = all(bool((i[1:] >= i[:-1]).all()) for i, _ in parts)  # O(k): blocks need it
    if out.dim() != 1 or out.device.type != "cpu" or numel <= BLOCK_NUMEL or not increasing:
        out.zero_()
        for indices, values in parts:
            out.index_add_(0, indices, values)
        return out.div_(divisor) if divisor != 1 else out  # x / 1 is x: no pass
    starts = np.arange(0, numel + BLOCK_NUMEL, BLOCK_NUMEL)  # (B + 1,), the last >= numel
    cuts = [np.searchsorted(indices.numpy(), starts) for indices, _ in parts]
    local = [indices & (BLOCK_NUMEL - 1) for indices, _ in parts]  # offsets inside a block
    for block, start in enumerate(starts[:-1]):
        piece = out[start : start + BLOCK_NUMEL]
        piece.zero_()
        for (_, values), cut, offsets in zip(parts, cuts, local, strict=True):
            lo, hi = int(cut[block]), int(cut[block + 1])
            if hi > lo:
                piece.index_add_(0, offsets[lo:hi], values[lo:hi])
        if divisor != 1:
            piece.div_(divisor)
    return out


def subtract_kept_(target: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``target`` ``(T, width)`` minus the dense decode of one message's distinct ``indices``
    and ``values``, at those positions only. The decode is ``0 + value`` (an ``index_add``
    into zeros turns -0 into +0), so the subtrahend is ``values + 0.0``: the same bits."""
    target.index_put_((indices,), target.index_select(0, indices).sub_(values + 0.0))
