"""The two-phase all-reduce's arithmetic on one rank, in cache-sized blocks of chunks (rows).

:mod:`.twophase` gives the algorithm and the layout; :mod:`superneurons.ddp.twophase` moves
the bytes. The three stages a rank computes are here, as pure functions of tensors (no
process group), so the hook runs them and the cost model (:mod:`superneurons.strategy.codecs`)
times exactly them:

* :func:`worker_encode`: add the residual, quantise each chunk, keep the new residual
  (``x - decode(q)``), pack every owner's segment of the message;
* :func:`owner_reduce`: decode the ``P`` copies of the owned slice, average them, add the
  owner's residual, re-quantise, keep its residual, pack the owned segment;
* :func:`decode_slices`: decode every owner's segment into the result.

Each stage walks the rows in blocks of 2**18 values and does all of its element-wise steps
while a block is in cache: a 25 MiB gradient is read and written about once per stage, where
the unblocked sequence (add, two reductions, scale, convert, dequantise, subtract, pack) swept
memory ~12 times. The operations per element, and so every bit, are those of the unblocked
sequence (tested against it), including stochastic rounding, whose counter-based draws are
taken at each block's positions of one key (:mod:`.coding.noise`).

Non-finite values (the project's policy): a chunk scale is a maximum (or an L1 norm) that NaN
and ±inf propagate into, so a stage reports "not finite" without another pass; its message
then carries NaN scales and zero codes, and the caller keeps the old residual (the new one is
written to a separate buffer).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from superneurons.codecs.coding import native
from superneurons.codecs.coding.bitpack import pack_rows_
from superneurons.codecs.coding.chunkquant import dequantize_rows, quantize_rows, read_block
from superneurons.codecs.coding.noise import draw_key
from superneurons.codecs.twophase import SliceLayout, TwoPhase

__all__ = [
    "BLOCK_VALUES",
    "RowWindow",
    "StageScratch",
    "decode_slices",
    "owner_reduce",
    "rounding_key",
    "worker_encode",
]

# NOTE: 2**18 values per block (1 MiB of fp32). Each block costs ~25 torch and numpy calls,
# so small blocks pay the calls, not the memory: the stage times of `measure_codecs` (one
# thread, 30M values, 2-core AMD EPYC, two rounds each) at 1 bit, worker + owner stage,
# 2**15: 337-434 ms, 2**16: 187-214 ms, 2**17: 135-162 ms, 2**18: 96-128 ms, 2**19: 90-103
# ms, 2**20: 101-113 ms, 2**21 and up: 133-146 ms (the owner's copies of every rank's block
# leave the caches); 4 bits alike. L2-sized blocks (2**16, 256 KiB) were chosen first and
# ran slower once the per-call work was cut. 2**19, 3-20% faster than 2**18 in `measure_codecs` (one
# process), cost more in the hook itself (two ranks on two cores, 30M values, three
# alternations, hook CPU per step at 1 bit: 181-230 ms against 170-178 ms).
BLOCK_VALUES = 1 << 18

Take = Callable[[str, int, torch.dtype], torch.Tensor]


@dataclass
class StageScratch:
    """Kept work buffers of a stage (``block`` values each; ``copies``/``levels`` hold one
    block from every rank). The caller keeps them across steps (no per-step allocation)."""

    work: torch.Tensor  # float32 (block,)
    x: torch.Tensor  # float32 (block,): the compensated block
    codes: torch.Tensor  # uint8 (block,)
    copies: torch.Tensor  # float32 (P * block,)
    levels: torch.Tensor  # uint8 (P * block,)
    scales: torch.Tensor  # float32 (>= P * rows,): every chunk's scale before it is written
    per_row: torch.Tensor  # float32 (3 * block rows,): a block's row maxima, minima, factors

    @classmethod
    def make(cls, layout: SliceLayout, take: Take, device: torch.device) -> StageScratch:
        """The buffers ``layout`` needs on ``device``, each from ``take(name, numel, dtype)``
        (e.g. a kept buffer of the caller's state; ``lambda _, n, d: torch.empty(n,
        dtype=d)``: fresh)."""
        block = _block_rows(layout, device) * layout.cols
        world = layout.world_size
        return cls(
            work=take("work", block, torch.float32),
            x=take("x", block, torch.float32),
            codes=take("codes", block, torch.uint8),
            copies=take("copies", world * block, torch.float32),
            levels=take("levels", world * block, torch.uint8),
            scales=take("scales", world * layout.rows, torch.float32),
            per_row=take("per_row", 3 * (block // layout.cols), torch.float32),
        )


@dataclass(frozen=True)
class RowWindow:
    """Where a stage call's rows sit in the whole tensor: rows ``first .. first + layout.rows``
    of each of its slices of ``slice_rows`` rows (a wave of :mod:`superneurons.ddp.twophase`,
    whose ``layout`` then describes the window). Stochastic rounding draws at the whole
    tensor's positions under one ``key`` (:func:`rounding_key`, drawn once per tensor and
    stage), so the bits do not depend on how a tensor is cut into windows."""

    first: int
    slice_rows: int
    key: object  # rounding_key(...): None for nearest rounding


def rounding_key(
    config: TwoPhase, generator: torch.Generator | None, device: torch.device
) -> object:
    """A stage's one key for stochastic rounding (None for nearest rounding: no draw)."""
    return draw_key(generator, device) if config.rounding == "stochastic" else None


def _block_rows(layout: SliceLayout, device: torch.device) -> int:
    """Rows per block: cache-sized on the CPU; on other devices every row at once (there
    kernel launches, not memory passes, dominate; as :mod:`.coding.noise` does)."""
    if device.type != "cpu":
        return layout.rows
    return max(1, min(layout.rows, BLOCK_VALUES // layout.cols))


def _body(layout: SliceLayout, first: int, count: int) -> slice:
    """Byte range, in a segment, of the packed codes of rows ``first .. first + count``."""
    per_row = layout.cols * layout.bits // 8
    start = 4 * layout.rows + first * per_row
    return slice(start, start + count * per_row)


def _finish(part: torch.Tensor, scales: torch.Tensor, layout: SliceLayout) -> bool:
    """Write every segment's scales (``scales``: ``(segments * rows,)``); a non-finite one
    makes all NaN and the codes zero (the message decodes to NaN everywhere)."""
    finite = bool(torch.isfinite(scales).all())
    heads = part[:, : 4 * layout.rows].view(torch.float32)  # (segments, rows)
    if finite:
        heads.copy_(scales.view(heads.shape))
    else:
        heads.fill_(float("nan"))
        part[:, _body(layout, 0, layout.rows)].zero_()
    return finite


def _quantize_block(
    x: torch.Tensor,
    error: torch.Tensor | None,
    config: TwoPhase,
    scratch: StageScratch,
    key: object,
    start: int,
    scales: torch.Tensor,
    body: torch.Tensor,
) -> None:
    """The codes of rows ``x`` (``(n, cols)``) packed into ``body`` (uint8 ``(1, n * cols *
    bits / 8)``), their scales into ``scales`` (``(n,)``), and ``error = x - decode`` if
    given."""
    values = x.numel()
    library = _native(config, x.device)
    if library is not None:
        _quantize_native(library, x, error, config.bits, scratch, scales, scratch.work, body)
        return
    if _fast(config, x.device):
        codes = _quantize_nearest_cpu(x, error, config.bits, scratch, scales, scratch.work)
        pack_rows_(codes.view(1, -1), config.bits, out=body)
        return
    codes, made = quantize_rows(
        x,
        bits=config.bits,
        rounding=config.rounding,
        codes=scratch.codes[:values],
        work=scratch.work[:values],
        noise_key=key,  # type: ignore[arg-type]
        noise_start=start,
    )
    if error is not None:
        decoded = dequantize_rows(codes, made, bits=config.bits, out=error)
        torch.sub(x, decoded, out=decoded)
    scales.copy_(made)
    pack_rows_(codes.view(1, -1), config.bits, out=body)


def _native(config: TwoPhase, device: torch.device) -> ctypes.CDLL | None:
    """The fused kernels (:mod:`.coding.native`) where they apply: the CPU's nearest rounding,
    where they could be built."""
    if device.type != "cpu" or config.rounding != "nearest":
        return None
    return native.kernels()


def _quantize_native(
    library: ctypes.CDLL,
    x: torch.Tensor,
    error: torch.Tensor | None,
    bits: int,
    scratch: StageScratch,
    scales: torch.Tensor,
    work: torch.Tensor,
    body: torch.Tensor,
    decoded: torch.Tensor | None = None,
) -> None:
    """:func:`_quantize_block`'s nearest rounding by the kernels, the same bits: at 1 bit the
    codes with ``|x|`` in one pass (into ``work``, a float32 scratch of ``x``'s size), torch's
    sum of it over ``cols`` for the scales (as :func:`~.coding.chunkquant.quantize_rows`), then
    the dequantised rows and residual where wanted; at 2, 4 and 8 bits the scales and factors
    of :func:`_grid_factors`, then one pass. The step is ``s * 2/m`` as ``dequantize_rows``
    computes it."""
    count, cols = x.shape
    step = scratch.per_row[:count]
    if bits == 1:
        magnitude = work[: count * cols].view(count, cols)
        native.sign_rows_into(library, x, packed=body.view(-1), magnitude=magnitude)
        torch.sum(magnitude, dim=1, out=scales).div_(cols)
        if decoded is None and error is None:
            return  # the codes do not depend on the scales
        torch.mul(scales, 2.0, out=step)
        factor, offset = None, 0.0
    else:
        levels = (1 << bits) - 1
        factor = _grid_factors(x, levels, scratch, scales)
        np.multiply(scales.numpy(), 2.0 / levels, out=step.numpy())
        offset = levels / 2.0 + 0.5
    native.quantize_rows_into(
        library, x, bits=bits, packed=body.view(-1), scale=scales, step=step, factor=factor,
        offset=offset, decoded=decoded, error=error,
    )  # fmt: skip


def _grid_factors(
    x: torch.Tensor, levels: int, scratch: StageScratch, scales: torch.Tensor
) -> torch.Tensor:
    """Each row's scale ``max(amax, -amin)`` into ``scales`` and its factor ``m/2 / s`` (0
    where ``s`` is not positive), in ``scratch.per_row[2n : 3n]`` (see
    :func:`_quantize_nearest_cpu` for the operations)."""
    count = x.shape[0]
    row = scratch.per_row
    top = torch.amax(x, dim=1, out=row[:count])
    bottom = torch.amin(x, dim=1, out=row[count : 2 * count]).neg_()
    torch.maximum(top, bottom, out=scales)
    factor = row[2 * count : 3 * count]
    s, f = scales.numpy(), factor.numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        np.reciprocal(s, out=f)
        np.multiply(f, levels / 2.0, out=f)
        np.copyto(f, 0.0, where=~(s > 0))  # torch.where(s > 0, ., 0): NaN and 0 give 0
    return factor


def _fast(config: TwoPhase, device: torch.device) -> bool:
    """The CPU's nearest rounding at 2, 4 or 8 bits: :func:`_quantize_nearest_cpu`."""
    return device.type == "cpu" and config.rounding == "nearest" and config.bits > 1


def _quantize_nearest_cpu(
    x: torch.Tensor,
    error: torch.Tensor | None,
    bits: int,
    scratch: StageScratch,
    scales: torch.Tensor,
    work: torch.Tensor,
    decoded: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~.coding.chunkquant.quantize_rows` (nearest) then ``x - dequantize_rows``, the
    same bits in fewer calls: ~15 torch and ~8 numpy calls per block instead of ~35 torch
    calls. The per-row arithmetic runs in numpy on ``(n,)`` views, the add and the conversion
    to uint8 are one numpy call (one pass less), the scales land in ``scales`` directly.
    ``work``: a float32 scratch of ``x``'s size, not ``x``'s storage; ``decoded``: where the
    dequantised rows go (else into ``error``, before it becomes the error). Measured on a 16.7M
    tensor (one thread, thread CPU time, best of 5, 4 alternations at load ~3.3 on 2 cores):
    worker stage 46-50 ms against 51-54 ms.

    The same operations per element as the general path: ``max(amax, -amin)`` (torch's
    ``maximum``, whose sign of zero numpy's does not share), ``reciprocal(s) * m/2`` (what
    ``m/2 / s`` computes), ``trunc(x * factor + (m/2 + 0.5))``, ``q * (s * 2/m) - s``."""
    count, cols = x.shape
    levels = (1 << bits) - 1
    half = levels / 2.0
    factor = _grid_factors(x, levels, scratch, scales)
    s, f = scales.numpy(), factor.numpy()
    y = torch.mul(x, factor.unsqueeze(1), out=work[: count * cols].view(count, cols))
    codes = scratch.codes[: count * cols].view(count, cols)
    with np.errstate(invalid="ignore"):  # NaN (non-finite input) casts as torch's does
        np.add(y.numpy(), half + 0.5, out=codes.numpy(), casting="unsafe")
    target = decoded if decoded is not None else error
    if target is not None:
        np.multiply(s, 2.0 / levels, out=f)  # the step, s * 2/m (factor is no longer needed)
        target.copy_(codes)
        target.mul_(factor.unsqueeze(1)).sub_(scales.unsqueeze(1))
    if error is not None:
        assert target is not None
        torch.sub(x, target, out=error)
    return codes


def worker_encode(
    rows: torch.Tensor,
    part: torch.Tensor,
    layout: SliceLayout,
    config: TwoPhase,
    scratch: StageScratch,
    *,
    residual: torch.Tensor | None,
    error: torch.Tensor | None,
    generator: torch.Generator | None = None,
    window: RowWindow | None = None,
) -> bool:
    """Worker side: ``rows + residual`` (float32 ``(P * rows, cols)``, or ``(P, rows, cols)``
    for a ``window`` of a larger tensor; ``rows`` is read only) quantised into the message
    ``part`` (uint8 ``(P, >= slice_bytes)``, segment ``j`` for owner ``j``); the new residual
    goes to ``error`` (shaped as ``rows``, not ``residual``'s storage) when given. Returns
    whether every value was finite (else ``error`` holds nothing to keep)."""
    per, (world, count_rows, cols) = _block_rows(layout, rows.device), _shape(layout)
    grid = rows.view(world, count_rows, cols)
    added = residual.view(world, count_rows, cols) if residual is not None else None
    errors = error.view(world, count_rows, cols) if error is not None else None
    key = window.key if window is not None else rounding_key(config, generator, rows.device)
    offset, slice_rows = (window.first, window.slice_rows) if window else (0, count_rows)
    for owner in range(world):
        for first in range(0, count_rows, per):
            count = min(per, count_rows - first)
            x = grid[owner, first : first + count]
            if added is not None:  # g + r into the cached block, not back to memory
                block = added[owner, first : first + count]
                x = torch.add(x, block, out=scratch.x[: x.numel()].view_as(x))
            block_error = errors[owner, first : first + count] if errors is not None else None
            at = owner * count_rows + first
            scales = scratch.scales[at : at + count]
            body = part[owner : owner + 1, _body(layout, first, count)]
            start = (owner * slice_rows + offset + first) * cols  # the whole tensor's position
            _quantize_block(x, block_error, config, scratch, key, start, scales, body)
    return _finish(part, scratch.scales[: world * count_rows], layout)


def _shape(layout: SliceLayout) -> tuple[int, int, int]:
    """``(P, rows, cols)``: the message's rows by owner."""
    return layout.world_size, layout.rows, layout.cols


def owner_reduce(
    received: torch.Tensor,
    owned: torch.Tensor,
    layout: SliceLayout,
    config: TwoPhase,
    scratch: StageScratch,
    *,
    residual: torch.Tensor | None,
    error: torch.Tensor | None,
    generator: torch.Generator | None = None,
    decoded: torch.Tensor | None = None,
    window: RowWindow | None = None,
) -> bool:
    """Owner side: decode the ``P`` copies of the owned slice (``received``: uint8 ``(P, >=
    slice_bytes)``), average them in fp32, add ``residual`` (``(rows, cols)``), re-quantise
    into ``owned`` (uint8 ``(1, >= slice_bytes)``), the new residual into ``error``.

    ``decoded`` (``(rows, cols)`` float32, optional): the owned slice as every rank will decode
    it from ``owned`` (:func:`decode_slices`' bits: the same dequantisation of the same codes
    and scales), written here on the way, so this rank need not decode its own segment of the
    all-gather (``decode_slices(skip=rank)``). Meaningless when this returns False.
    ``window``: these are rows ``window.first ..`` of the owned slice (see :class:`RowWindow`).
    """
    per, cols = _block_rows(layout, received.device), layout.cols
    if window is not None:
        key, offset = window.key, window.first
    else:
        key, offset = rounding_key(config, generator, received.device), 0
    for first in range(0, layout.rows, per):
        count = min(per, layout.rows - first)
        values = count * cols
        heads = received[:, 4 * first : 4 * (first + count)].view(torch.float32)
        body = received[:, _body(layout, first, count)]
        average = scratch.work[:values].view(count, cols)
        block_residual = residual[first : first + count] if residual is not None else None
        _average(heads, body, config, scratch, block_residual, out=average)
        block_error = error[first : first + count] if error is not None else None
        block_decoded = decoded[first : first + count] if decoded is not None else None
        scales = scratch.scales[first : first + count]
        body_out = owned[:, _body(layout, first, count)]
        library = _native(config, received.device)
        if library is not None:
            # NOTE: the |x| scratch is `copies` (free now): `work` holds the average.
            _quantize_native(
                library, average, block_error, config.bits, scratch, scales, scratch.copies,
                body_out, block_decoded,
            )  # fmt: skip
            continue
        if _fast(config, received.device):
            # NOTE: the work buffer is `copies` (free now): `work` holds the average.
            codes = _quantize_nearest_cpu(
                average, block_error, config.bits, scratch, scales, scratch.copies, block_decoded
            )
        else:
            # NOTE: the codes' work buffer is `copies` (free now): `work` holds the average.
            codes, made = quantize_rows(
                average,
                bits=config.bits,
                rounding=config.rounding,
                codes=scratch.codes[:values],
                work=scratch.copies[:values],
                noise_key=key,  # type: ignore[arg-type]
                noise_start=(offset + first) * cols,
            )
            target = block_decoded if block_decoded is not None else block_error
            if target is not None:
                dequantize_rows(codes, made, bits=config.bits, out=target)
            if block_error is not None:
                assert target is not None
                torch.sub(average, target, out=block_error)
            scales.copy_(made)
        pack_rows_(codes.view(1, -1), config.bits, out=body_out)
    return _finish(owned, scratch.scales[: layout.rows], layout)


def _average(
    heads: torch.Tensor,
    body: torch.Tensor,
    config: TwoPhase,
    scratch: StageScratch,
    residual: torch.Tensor | None,
    *,
    out: torch.Tensor,
) -> None:
    """The owner's rows ``out`` (``(n, cols)``): every rank's copy (scales ``heads`` ``(P,
    n)``, codes ``body``) decoded, summed in fp32, divided by ``P``, plus ``residual``; on two
    ranks with the kernels, in one pass (the same bits)."""
    world, (count, cols) = heads.shape[0], out.shape
    library = _native(config, out.device)
    if library is not None and world == 2:
        steps = heads * (2.0 / ((1 << config.bits) - 1))  # as read_block computes the step
        native.average_two_into(
            library, (body[0], body[1]), bits=config.bits, steps=(steps[0], steps[1]),
            scales=(heads[0], heads[1]), residual=residual, out=out,
        )  # fmt: skip
        return
    copies = scratch.copies[: world * count * cols].view(world, count, cols)
    _read_block(heads, body, config, out=copies, levels=scratch.levels)
    _sum_rows(copies.view(world, -1), out.view(-1)).div_(world)
    if residual is not None:
        out.add_(residual)


def _sum_rows(copies: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``torch.sum(copies, dim=0, out=out)``, bitwise. NOTE: for two ranks as ``(c0 + c1) +
    0.0``: the sum's accumulator starts at +0, which only turns a -0 result into +0, and two
    adds ran ~4x faster than the strided reduction (2**18 values, one thread)."""
    if copies.shape[0] != 2:
        return torch.sum(copies, dim=0, out=out)
    return torch.add(copies[0], copies[1], out=out).add_(0.0)


def decode_slices(
    gathered: torch.Tensor,
    rows: torch.Tensor,
    layout: SliceLayout,
    config: TwoPhase,
    scratch: StageScratch,
    *,
    skip: int | None = None,
) -> torch.Tensor:
    """Every rank: decode every owner's segment (``gathered``: uint8 ``(P, >= slice_bytes)``)
    into ``rows`` (float32 ``(P * rows, cols)``, or ``(P, rows, cols)`` for a window of a larger
    tensor), block by block; ``skip``: an owner whose rows hold their decode already
    (:func:`owner_reduce`'s ``decoded``)."""
    per, (world, count_rows, cols) = _block_rows(layout, rows.device), _shape(layout)
    grid = rows.view(world, count_rows, cols)
    for owner in range(world):
        if owner == skip:
            continue
        segment = gathered[owner : owner + 1]
        for first in range(0, count_rows, per):
            count = min(per, count_rows - first)
            heads = segment[:, 4 * first : 4 * (first + count)].view(torch.float32)
            body = segment[:, _body(layout, first, count)]
            out = grid[owner, first : first + count].view(1, count, cols)
            _read_block(heads, body, config, out=out, levels=scratch.levels)
    return rows


def _read_block(
    heads: torch.Tensor,
    body: torch.Tensor,
    config: TwoPhase,
    *,
    out: torch.Tensor,
    levels: torch.Tensor,
) -> None:
    """:func:`~.coding.chunkquant.read_block` (``heads``: the scales ``(blocks, n)``, ``body``
    their packed codes, ``out`` float32 ``(blocks, n, cols)``), by the fused kernel where it
    applies: the same ``q * (s * 2/m) - s``, the step computed as torch computes it there."""
    library = _native(config, out.device)
    if library is None:
        read_block(heads, body, bits=config.bits, out=out, levels=levels)
        return
    step = heads * (2.0 / ((1 << config.bits) - 1))
    for block in range(out.shape[0]):
        native.dequantize_rows_into(
            library, body[block], bits=config.bits, step=step[block], scale=heads[block],
            out=out[block],
        )  # fmt: skip
