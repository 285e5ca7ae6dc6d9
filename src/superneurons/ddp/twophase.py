"""The two-phase compressed all-reduce across ranks: all-to-all, owner re-quantisation,
all-gather, with error feedback at the worker and at the owner (see
:mod:`superneurons.codecs.twophase` for the algorithm, its sources and the layout).

:func:`exchange` averages named flat tensors in place; the DDP hook passes a bucket's
parameters (:mod:`.reduce`), and anything else that averages a flat vector with error
feedback (an outer gradient, an optimizer's momentum) calls :func:`average_` with its own
:class:`TwoPhaseState`. The message one rank sends to owner ``j`` (its *segment* of a wave,
below) is the concatenation of every tensor's rows of slice ``j`` in that wave, in the order
given, which must be the same on every rank; each tensor's residuals are keyed by its name, so they do not depend on DDP's
bucket layout (rebuilt after the first step and on resume).

Collectives, issued from the caller's thread in this order on every rank: the exchange is
cut into waves (rows of every slice of every tensor, :data:`WAVE_BYTES` of all-to-all input
each, a function of the sizes and configs; one wave for most buckets): :func:`start` issues
ONE ``all_to_all_single`` per wave as soon as the wave is encoded, so the first waves travel
while the next are encoded; :func:`complete` waits for each in turn, runs the owners' stage of
that wave and issues its ONE ``all_gather`` (asynchronous; the decode runs when all have
completed), so the all-gather of one wave travels while the owners re-quantise the next.
Every value goes through the same operations in any cut (the bits do not depend on the
waves). The DDP hook runs :func:`complete` at the start of the next bucket's hook, so the
all-to-alls overlap that bucket's backward (:func:`twophase_reduce`). gloo and NCCL both
implement ``all_to_all_single`` (gloo's was checked on torch 2.13: ``alltoall_base``); both
buffers are fixed-size, so no sizes are exchanged.

Non-finite values (the project's policy): a rank whose compensated tensor holds NaN/Inf
sends NaN scales (in that wave), every owner's average of those rows is NaN, and a NaN scale
anywhere in the gathered bytes makes the whole tensor NaN on every rank; residuals are only
updated from finite values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from superneurons.codecs.coding.orthogonal import forward_, inverse_
from superneurons.codecs.twophase import SliceLayout, TwoPhase
from superneurons.codecs.twophase_stages import (
    RowWindow,
    StageScratch,
    decode_slices,
    owner_reduce,
    rounding_key,
    worker_encode,
)
from superneurons.compat import all_gather_into_tensor
from superneurons.ddp.callbacks import then_same_threads
from superneurons.ddp.twophase_state import TwoPhaseState
from superneurons.errors import ConfigError

Future = torch.futures.Future[Any]

__all__ = [
    "Exchange",
    "Started",
    "WAVE_BYTES",
    "TwoPhaseState",
    "average_",
    "complete",
    "exchange",
    "start",
]

Generators = Callable[[str], torch.Generator]


@dataclass(frozen=True)
class Exchange:
    """A started exchange: ``future`` completes when the all-gather is done; ``finish()``
    then decodes every owner's slice into the tensors (call it once, after ``future``)."""

    future: torch.futures.Future[Any]
    finish: Callable[[], None]
    bytes_sent: int  # the inputs of the two collectives: P segments, then one


# NOTE: bytes of one rank's all-to-all input per wave. An exchange travels in waves of about
# this size (rows of every slice of every tensor): the all-to-all of one wave travels while
# the next is encoded, and the all-gather of one while the owners re-quantise the next.
# Measured in the DDP hook (`superneurons bench network --bandwidth 1gbit --models fc-heavy
# --steps 20`, 2 ranks; its 25.7M-value bucket is 12.8 MB at 4 bits), waves of a fixed number
# of values, mean step of 3 alternated runs in each of two sets: at 4 bits, one wave 0.617 s
# against 0.577 s in waves of 2**22 values (2 MiB); one wave 0.648 s against 0.556 s in waves
# of 2**23 values (4 MiB) and 0.599 s in two waves. At 1 bit (3.2 MB in all) waves cost more
# than they hid: one wave 0.528 s, waves of 2**23 values (1 MiB) 0.568 s.
WAVE_BYTES = 1 << 22


@dataclass(frozen=True)
class _Item:
    name: str
    flat: torch.Tensor  # (numel,) float32, contiguous: averaged in place
    config: TwoPhase
    layout: SliceLayout


@dataclass(frozen=True)
class _Part:
    """Rows ``first .. first + layout.rows`` of each slice of ``item`` in one wave: ``layout``
    describes the window; ``offset`` is its byte offset in the wave's segment."""

    index: int  # the item's place in the exchange
    item: _Item
    first: int
    layout: SliceLayout
    offset: int


@dataclass(frozen=True)
class _Wave:
    parts: list[_Part]
    segment: int  # bytes of one owner's segment of this wave


@dataclass(frozen=True)
class Started:
    """An exchange whose all-to-alls are in flight: :func:`complete` runs the owners' stage and
    issues the all-gathers (the second phase; on every rank in the same place in the order of
    collectives)."""

    items: list[_Item]
    waves: list[_Wave]
    key: tuple[Any, ...]
    received: list[torch.Tensor]  # per wave
    works: list[Any]  # per wave: the all-to-all's Work
    state: TwoPhaseState
    group: dist.ProcessGroup | None
    error_feedback: bool
    generators: Generators | None
    bytes_sent: int


def exchange(
    tensors: Sequence[tuple[str, torch.Tensor, TwoPhase]],
    state: TwoPhaseState,
    *,
    group: dist.ProcessGroup | None,
    error_feedback: bool,
    generators: Generators | None = None,
    wave_bytes: int = WAVE_BYTES,
) -> Exchange:
    """Start averaging ``(name, flat float32 tensor, config)`` across ``group`` in place.

    Collective (see the module docs): :func:`start` then :func:`complete`. ``tensors`` may be
    overwritten as scratch before the result arrives. ``generators(key)`` draws the
    stochastic rounding of ``key`` (a tensor's name, ``name + "/owner"`` for the owner's
    stage): derive it from (seed, rank, step, key) for reproducible runs; None uses torch's
    default generator. ``wave_bytes``: see :func:`start`.
    """
    started = start(
        tensors, state, group=group, error_feedback=error_feedback, generators=generators,
        wave_bytes=wave_bytes,
    )  # fmt: skip
    return complete(started)


def start(
    tensors: Sequence[tuple[str, torch.Tensor, TwoPhase]],
    state: TwoPhaseState,
    *,
    group: dist.ProcessGroup | None,
    error_feedback: bool,
    generators: Generators | None = None,
    wave_bytes: int = WAVE_BYTES,
) -> Started:
    """The first phase: every tensor's slices quantised, the all-to-alls issued (not waited
    for). Collective: call :func:`complete` before any later collective of this group.

    The exchange travels in waves of about ``wave_bytes`` of this rank's all-to-all input
    (every wave holds rows of each slice of each tensor; the same on every rank, a function
    of the sizes and configs): a wave's all-to-all is issued as soon as it is encoded. The
    bits do not depend on the waves."""
    world_size = dist.get_world_size(group)
    if state.world_size is None:
        state.world_size = world_size
    elif state.world_size != world_size:
        raise ConfigError(
            f"this two-phase state belongs to a group of {state.world_size} ranks, not {world_size}"
        )
    if wave_bytes < 1:
        raise ConfigError(f"two-phase: wave_bytes must be >= 1, got {wave_bytes}")
    items = []
    for name, flat, config in tensors:
        if flat.dtype != torch.float32 or not flat.is_contiguous() or flat.dim() != 1:
            raise ConfigError(f"two-phase: {name!r} must be a flat contiguous float32 tensor")
        if state.configs.get(name, config) != config:  # another layout: send what it owes
            owed = state.release(name, flat.numel(), dist.get_rank(group))
            if owed is not None:
                flat.add_(owed)
        items.append(_Item(name, flat, config, config.layout(flat.numel(), world_size)))
        if error_feedback:
            state.configs[name] = config
    waves = _waves(items, wave_bytes)
    device = tensors[0][1].device if tensors else torch.device("cpu")
    key = tuple((i.name, i.config.spec, i.flat.numel()) for i in items)
    stages = [_stage("worker", item, state, error_feedback, generators) for item in items]
    inputs: dict[int, torch.Tensor] = {}  # where several waves read them (else made in turn)
    received, works, sent = [], [], 0
    for index, wave in enumerate(waves):
        send = state.buffer(("send", index, *key), world_size * wave.segment, torch.uint8, device)
        into = state.buffer(
            ("received", index, *key), world_size * wave.segment, torch.uint8, device
        )
        table = send.view(world_size, wave.segment)
        for part in wave.parts:
            rows = inputs.get(part.index)
            if rows is None:
                rows = _encode_input(part, state, several=len(waves) > 1)
                if len(waves) > 1:
                    inputs[part.index] = rows
            _encode(part, state, table, rows, stages[part.index])
        works.append(dist.all_to_all_single(into, send, group=group, async_op=True))
        received.append(into)
        sent += send.numel() + wave.segment
    for item, stage in zip(items, stages, strict=True):
        stage.keep(state.worker, item.name)
    return Started(
        items, waves, key, received, works, state, group, error_feedback, generators, sent
    )


def complete(started: Started) -> Exchange:
    """The second phase of :func:`start`'s exchange: for each wave, wait for its all-to-all,
    average and re-quantise the owned rows, issue its all-gather (asynchronous)."""
    state, key, items = started.state, started.key, started.items
    world_size = dist.get_world_size(started.group)
    rank = dist.get_rank(started.group)
    stages = [
        _stage("owner", item, state, started.error_feedback, started.generators) for item in items
    ]
    own = [_own_rows(item, rank) for item in items]
    gathered, works, decoded = [], [], []
    for index, (wave, work) in enumerate(zip(started.waves, started.works, strict=True)):
        work.wait()
        device = started.received[index].device
        owned = state.buffer(("owned", index, *key), wave.segment, torch.uint8, device)
        received = started.received[index].view(world_size, wave.segment)
        done = []  # per part: its own rows already decoded in place (the owner's stage)
        for part in wave.parts:
            at = part.index
            done.append(_reduce_owned(part, state, received, owned, stages[at], own[at]))
        into = state.buffer(
            ("gathered", index, *key), world_size * wave.segment, torch.uint8, device
        )
        works.append(all_gather_into_tensor(into, owned, group=started.group, async_op=True))
        gathered.append(into)
        decoded.append(done)
    for item, stage in zip(items, stages, strict=True):
        stage.keep(state.owner, item.name)
    waves = [
        (wave, table.view(world_size, wave.segment), done)
        for wave, table, done in zip(started.waves, gathered, decoded, strict=True)
    ]

    def finish() -> None:
        for item in items:
            _decode(item, state, waves, key, rank)

    future = works[0].get_future() if len(works) == 1 else _all(works)
    return Exchange(future, finish, started.bytes_sent)


def average_(
    tensors: Sequence[tuple[str, torch.Tensor, TwoPhase]],
    state: TwoPhaseState,
    *,
    group: dist.ProcessGroup | None = None,
    error_feedback: bool = True,
    generators: Generators | None = None,
    wave_bytes: int = WAVE_BYTES,
) -> int:
    """:func:`exchange`, waited for: every tensor holds the average when it returns.
    Returns the bytes this rank put into the two collectives."""
    started = exchange(
        tensors, state, group=group, error_feedback=error_feedback, generators=generators,
        wave_bytes=wave_bytes,
    )  # fmt: skip
    then_same_threads(started.future, lambda _: started.finish()).wait()
    return started.bytes_sent


def _all(works: list[Any]) -> Future:
    """One future for several collectives, failed when one of them failed (``collect_all``
    alone completes with the failed future in its list)."""

    def values(done: Future) -> list[Any]:
        return [part.value() for part in done.value()]  # raises the first failure

    return torch.futures.collect_all([w.get_future() for w in works]).then(values)


def _waves(items: list[_Item], wave_bytes: int) -> list[_Wave]:
    """The exchange's waves: ``K`` of them, ``K = ceil(message / wave_bytes)`` for a message
    (the all-to-all's input) of ``P`` segments (at most the rows of the longest slice); wave
    ``k`` holds rows ``k R / K .. (k + 1) R / K`` of each slice of each tensor with ``R`` rows
    per slice, in the order of ``items``."""
    message = sum(i.layout.world_size * i.layout.slice_bytes for i in items)
    most_rows = max((i.layout.rows for i in items), default=1)
    count = max(1, min(-(-message // wave_bytes), most_rows))
    waves = []
    for k in range(count):
        parts, offset = [], 0
        for index, item in enumerate(items):
            rows = item.layout.rows
            first, stop = k * rows // count, (k + 1) * rows // count
            if stop == first:
                continue
            layout = _window(item.layout, stop - first)
            parts.append(_Part(index, item, first, layout, offset))
            offset += layout.slice_bytes
        waves.append(_Wave(parts, offset))
    return waves


def _window(layout: SliceLayout, rows: int) -> SliceLayout:
    """The layout of ``rows`` rows of each slice (a wave's share of a tensor)."""
    if rows == layout.rows:
        return layout
    numel = layout.world_size * rows * layout.cols
    return SliceLayout(numel, layout.world_size, rows * layout.cols, layout.cols, layout.bits)


def _part(table: torch.Tensor, part: _Part) -> torch.Tensor:
    """This part's bytes in every segment: ``(rows of table, slice_bytes)`` uint8 view."""
    return table[:, part.offset : part.offset + part.layout.slice_bytes]


def _rows(flat: torch.Tensor, part: _Part) -> torch.Tensor:
    """``part``'s rows of a whole tensor's ``(P * rows, cols)`` values: ``(P, rows, cols)``."""
    whole = part.item.layout
    grid = flat.view(whole.world_size, whole.rows, whole.cols)
    return grid[:, part.first : part.first + part.layout.rows]


def _generator(generators: Generators | None, key: str) -> torch.Generator | None:
    return generators(key) if generators is not None else None


def _scratch(
    state: TwoPhaseState, layout: SliceLayout, tag: str, device: torch.device
) -> StageScratch:
    """A stage's kept buffers: one set for the encode and owner stages (they run one after
    another on the caller's thread), one per exchange for its decode (which may run on the
    backend's thread while the next bucket encodes)."""

    def take(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return state.buffer((tag, name), numel, dtype, device)

    return StageScratch.make(layout, take, device)


def _encode_input(part: _Part, state: TwoPhaseState, *, several: bool) -> torch.Tensor:
    """The worker's input rows ``(P * rows, cols)`` of ``part``'s tensor: the tensor itself
    (overwritten by the average), or a kept buffer where it is padded or transformed: one for
    every tensor, which they fill in turn, or with ``several`` waves, one per place in the
    exchange (the waves read them all; kept across exchanges, which encode one at a time)."""
    item = part.item
    layout, config, name = item.layout, item.config, item.name
    if _in_place(item):
        return item.flat.view(-1, layout.cols)  # NOTE: in place: overwritten by the average
    # NOTE: decodes may run on the backend's thread meanwhile: they have their own buffers
    # (per exchange, see _decode).
    tag = ("x", part.index) if several else ("x",)
    x = state.buffer(tag, layout.padded_numel, torch.float32, item.flat.device)
    x[: layout.numel].copy_(item.flat)
    x[layout.numel :].zero_()
    rows = x.view(-1, layout.cols)  # (P * rows, cols)
    if config.transform != "none":
        rows = forward_(rows, config.transform, state.signs(name, layout.cols, x.device))
    return rows


@dataclass
class _Stage:
    """One tensor's stage (the worker's or the owner's) across the waves: its residual, where
    the new one goes, its rounding key, whether every wave was finite; :meth:`keep` then
    replaces the residual (a non-finite step keeps the old one)."""

    residual: torch.Tensor | None
    error: torch.Tensor | None
    key: object
    finite: bool = True

    def keep(self, kept: dict[str, torch.Tensor], name: str) -> None:
        if self.error is not None and self.finite:
            kept[name] = self.error


def _stage(
    kind: str,
    item: _Item,
    state: TwoPhaseState,
    error_feedback: bool,
    generators: Generators | None,
) -> _Stage:
    """``item``'s ``kind`` stage: "worker" (its residual covers the padded tensor; rounding
    drawn from ``generators(name)``) or "owner" (the owned slice; ``name + "/owner"``)."""
    layout, device, name = item.layout, item.flat.device, item.name
    kept = state.worker if kind == "worker" else state.owner
    numel = layout.padded_numel if kind == "worker" else layout.slice_numel
    residual = kept.get(name) if error_feedback else None
    quantised = error_feedback and item.config.bits != 32
    error = state.spare(kind, name, numel, device) if quantised else None
    draws = name if kind == "worker" else name + "/owner"
    return _Stage(residual, error, rounding_key(item.config, _generator(generators, draws), device))


def _encode(
    part: _Part, state: TwoPhaseState, send: torch.Tensor, rows: torch.Tensor, stage: _Stage
) -> None:
    """Worker side, one wave of one tensor: compensate and quantise its rows of ``rows`` (the
    transformed input), owner j's into segment j of ``send``."""
    layout, config, whole = part.layout, part.item.config, part.item.layout
    grid = _rows(rows, part)  # (P, rows, cols)
    out = _part(send, part)
    residual = _rows(stage.residual, part) if stage.residual is not None else None
    if config.bits == 32:  # NaN and ±inf travel as they are
        if residual is not None:
            grid.add_(residual)
        out.view(torch.float32).view(grid.shape).copy_(grid)
        return
    stage.finite &= worker_encode(
        grid, out, layout, config, _scratch(state, layout, "stage", rows.device),
        residual=residual,
        error=_rows(stage.error, part) if stage.error is not None else None,
        window=RowWindow(part.first, whole.rows, stage.key),
    )  # fmt: skip


def _reduce_owned(
    part: _Part,
    state: TwoPhaseState,
    received: torch.Tensor,
    owned: torch.Tensor,
    stage: _Stage,
    own_rows: torch.Tensor | None,
) -> bool:
    """Owner side, one wave of one tensor: average the P copies of this rank's rows,
    compensate, re-quantise. The re-quantised rows are also decoded into ``own_rows`` when
    given (this rank's rows of the whole tensor, which the decode writes in place); returns
    whether they were (given, finite, quantised), so that the decode skips this rank's
    segment of the wave.

    NOTE: the decode of one's own segment of the all-gather is then a copy never made: at
    P = 2 half of the decode stage (the same bits: the same dequantisation of the same codes
    and scales, see :func:`~superneurons.codecs.twophase_stages.owner_reduce`)."""
    layout, config, cols = part.layout, part.item.config, part.layout.cols
    world_size, device = layout.world_size, received.device
    parts = _part(received, part)
    out = owned[part.offset : part.offset + layout.slice_bytes].view(1, -1)
    rows = slice(part.first, part.first + layout.rows)
    residual = stage.residual.view(-1, cols)[rows] if stage.residual is not None else None
    if config.bits == 32:
        copies = state.buffer(("copies",), layout.padded_numel, torch.float32, device)
        copies.view(world_size, -1).copy_(parts.view(torch.float32))
        average = state.buffer(("average",), layout.slice_numel, torch.float32, device)
        torch.sum(copies.view(world_size, layout.slice_numel), dim=0, out=average)
        average.div_(world_size)
        if residual is not None:
            average.add_(residual.reshape(-1))
        out.view(torch.float32).copy_(average.view(1, -1))
        return False
    finite = owner_reduce(
        parts, out, layout, config, _scratch(state, layout, "stage", device),
        residual=residual,
        error=stage.error.view(-1, cols)[rows] if stage.error is not None else None,
        decoded=own_rows[rows] if own_rows is not None else None,
        window=RowWindow(part.first, part.item.layout.rows, stage.key),
    )  # fmt: skip
    stage.finite &= finite
    return finite and own_rows is not None


def _own_rows(item: _Item, rank: int) -> torch.Tensor | None:
    """This rank's rows of the tensor itself, where the decode writes in place.

    NOTE: only there: the other items of an exchange share one decode buffer, which their
    decodes fill one after another."""
    if not _in_place(item):
        return None
    layout = item.layout
    return item.flat.view(-1, layout.cols)[rank * layout.rows : (rank + 1) * layout.rows]


def _in_place(item: _Item) -> bool:
    return item.layout.padded_numel == item.layout.numel and item.config.transform == "none"


def _decode_rows(item: _Item, state: TwoPhaseState, key: tuple[Any, ...]) -> torch.Tensor:
    """Where the decode writes every owner's slice: ``(P * rows, cols)`` rows of the tensor
    itself, or of a kept buffer (padding, a transform to undo)."""
    layout = item.layout
    if _in_place(item):
        x = item.flat
    else:
        x = state.buffer(("decode", *key), layout.padded_numel, torch.float32, item.flat.device)
    return x.view(-1, layout.cols)


def _decode(
    item: _Item,
    state: TwoPhaseState,
    waves: list[tuple[_Wave, torch.Tensor, list[bool]]],
    key: tuple[Any, ...],
    rank: int,
) -> None:
    """Every rank: decode every owner's rows of ``item`` from each wave's all-gather (but
    this rank's where the owner's stage decoded them), undo the transform, write the average.
    A non-finite scale anywhere makes the whole tensor NaN (the module's policy; the same
    bytes, so the same result, on every rank)."""
    layout, config, name = item.layout, item.config, item.name
    rows = _decode_rows(item, state, key)
    finite_parts: list[torch.Tensor] = []  # one flag per part, read on the host once
    for wave, table, decoded in waves:
        for part, skip in zip(wave.parts, decoded, strict=True):
            if part.item is not item:
                continue
            grid, parts = _rows(rows, part), _part(table, part)
            if config.bits == 32:
                grid.copy_(parts.view(torch.float32).view(grid.shape))
                continue
            scratch = _scratch(state, part.layout, f"decode {key}", rows.device)
            decode_slices(parts, grid, part.layout, config, scratch, skip=rank if skip else None)
            heads = parts[:, : 4 * part.layout.rows].view(torch.float32)
            finite_parts.append(torch.isfinite(heads).all())
    # NOTE: one host read per tensor, not per wave (on CUDA each read waits for the device)
    if finite_parts and not bool(torch.stack(finite_parts).all()):
        rows.fill_(float("nan"))
    if config.transform != "none":
        rows = inverse_(rows, config.transform, state.signs(name, layout.cols, rows.device))
    if not _in_place(item):
        item.flat.copy_(rows.reshape(-1)[: layout.numel])
