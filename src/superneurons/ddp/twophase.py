"""The two-phase compressed all-reduce across ranks: all-to-all, owner re-quantisation,
all-gather, with error feedback at the worker and at the owner (see
:mod:`superneurons.codecs.twophase` for the algorithm, its sources and the layout).

:func:`exchange` averages named flat tensors in place; the DDP hook passes a bucket's
parameters (:mod:`.reduce`), and anything else that averages a flat vector with error
feedback (an outer gradient, an optimizer's momentum) calls :func:`average_` with its own
:class:`TwoPhaseState`. The message one rank sends to owner ``j`` (its *segment*) is the
concatenation of every tensor's slice ``j`` in the order given, which must be the same on
every rank; each tensor's residuals are keyed by its name, so they do not depend on DDP's
bucket layout (rebuilt after the first step and on resume).

Collectives, issued from the caller's thread in this order on every rank: ONE
``all_to_all_single`` (:func:`start`), waited for by :func:`complete` (the owners need it),
which then issues ONE ``all_gather`` (asynchronous; the decode runs when it completes). The
DDP hook runs :func:`complete` at the start of the next bucket's hook, so the all-to-all
overlaps that bucket's backward (:func:`twophase_reduce`). gloo and NCCL both implement
``all_to_all_single`` (gloo's was checked on torch 2.13: ``alltoall_base``); both buffers
are fixed-size, so no sizes are exchanged.

Non-finite values (the project's policy): a rank whose compensated tensor holds NaN/Inf
sends NaN scales, every owner's average of that tensor is NaN, and so is the result on
every rank; residuals are only updated from finite values.
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
    StageScratch,
    decode_slices,
    owner_reduce,
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


@dataclass(frozen=True)
class _Item:
    name: str
    flat: torch.Tensor  # (numel,) float32, contiguous: averaged in place
    config: TwoPhase
    layout: SliceLayout
    offset: int  # byte offset of this tensor's slice in a segment


@dataclass(frozen=True)
class Started:
    """An exchange whose all-to-all is in flight: :func:`complete` runs the owners' stage and
    issues the all-gather (the second phase; on every rank in the same place in the order of
    collectives)."""

    items: list[_Item]
    key: tuple[Any, ...]
    segment: int
    received: torch.Tensor
    work: Any  # the all-to-all's Work
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
) -> Exchange:
    """Start averaging ``(name, flat float32 tensor, config)`` across ``group`` in place.

    Collective (see the module docs): :func:`start` then :func:`complete`. ``tensors`` may be
    overwritten as scratch before the result arrives. ``generators(key)`` draws the
    stochastic rounding of ``key`` (a tensor's name, ``name + "/owner"`` for the owner's
    stage): derive it from (seed, rank, step, key) for reproducible runs; None uses torch's
    default generator.
    """
    started = start(
        tensors, state, group=group, error_feedback=error_feedback, generators=generators
    )
    return complete(started)


def start(
    tensors: Sequence[tuple[str, torch.Tensor, TwoPhase]],
    state: TwoPhaseState,
    *,
    group: dist.ProcessGroup | None,
    error_feedback: bool,
    generators: Generators | None = None,
) -> Started:
    """The first phase: every tensor's slices quantised, the all-to-all issued (not waited
    for). Collective: call :func:`complete` before any later collective of this group."""
    world_size = dist.get_world_size(group)
    if state.world_size is None:
        state.world_size = world_size
    elif state.world_size != world_size:
        raise ConfigError(
            f"this two-phase state belongs to a group of {state.world_size} ranks, not {world_size}"
        )
    items, offset = [], 0
    for name, flat, config in tensors:
        if flat.dtype != torch.float32 or not flat.is_contiguous() or flat.dim() != 1:
            raise ConfigError(f"two-phase: {name!r} must be a flat contiguous float32 tensor")
        if state.configs.get(name, config) != config:  # another layout: send what it owes
            owed = state.release(name, flat.numel(), dist.get_rank(group))
            if owed is not None:
                flat.add_(owed)
        layout = config.layout(flat.numel(), world_size)
        items.append(_Item(name, flat, config, layout, offset))
        if error_feedback:
            state.configs[name] = config
        offset += layout.slice_bytes
    segment = offset
    device = tensors[0][1].device if tensors else torch.device("cpu")
    key = tuple((i.name, i.config.spec, i.flat.numel()) for i in items)
    send = state.buffer(("send", *key), world_size * segment, torch.uint8, device)
    received = state.buffer(("received", *key), world_size * segment, torch.uint8, device)
    for item in items:
        _encode(item, state, send.view(world_size, segment), error_feedback, generators)
    work = dist.all_to_all_single(received, send, group=group, async_op=True)
    return Started(
        items, key, segment, received, work, state, group, error_feedback, generators,
        send.numel() + segment,
    )  # fmt: skip


def complete(started: Started) -> Exchange:
    """The second phase of :func:`start`'s exchange: wait for the all-to-all, average and
    re-quantise the owned slices, issue the all-gather (asynchronous)."""
    state, segment, key = started.state, started.segment, started.key
    world_size = dist.get_world_size(started.group)
    rank = dist.get_rank(started.group)
    started.work.wait()
    device = started.received.device
    owned = state.buffer(("owned", *key), segment, torch.uint8, device)
    decoded = []  # per item: its own slice already decoded in place (the owner's stage)
    for item in started.items:
        received = started.received.view(world_size, segment)
        # NOTE: only where the decode writes into the tensor itself: the other items of an
        # exchange share one decode buffer, which their decodes fill one after another.
        mine = slice(rank * item.layout.rows, (rank + 1) * item.layout.rows)
        own_rows = item.flat.view(-1, item.layout.cols)[mine] if _in_place(item) else None
        decoded.append(
            _reduce_owned(
                item, state, received, owned, started.error_feedback, started.generators,
                own_rows=own_rows,
            )
        )  # fmt: skip
    gathered = state.buffer(("gathered", *key), world_size * segment, torch.uint8, device)
    work = all_gather_into_tensor(gathered, owned, group=started.group, async_op=True)

    def finish() -> None:
        table = gathered.view(world_size, segment)
        for item, skip in zip(started.items, decoded, strict=True):
            _decode(item, state, table, key, skip=rank if skip else None)

    return Exchange(work.get_future(), finish, started.bytes_sent)


def average_(
    tensors: Sequence[tuple[str, torch.Tensor, TwoPhase]],
    state: TwoPhaseState,
    *,
    group: dist.ProcessGroup | None = None,
    error_feedback: bool = True,
    generators: Generators | None = None,
) -> int:
    """:func:`exchange`, waited for: every tensor holds the average when it returns.
    Returns the bytes this rank put into the two collectives."""
    started = exchange(
        tensors, state, group=group, error_feedback=error_feedback, generators=generators
    )
    then_same_threads(started.future, lambda _: started.finish()).wait()
    return started.bytes_sent


def _part(table: torch.Tensor, item: _Item) -> torch.Tensor:
    """This tensor's part of every segment: ``(rows of table, slice_bytes)`` uint8 view."""
    return table[:, item.offset : item.offset + item.layout.slice_bytes]


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


def _encode(
    item: _Item,
    state: TwoPhaseState,
    send: torch.Tensor,
    error_feedback: bool,
    generators: Generators | None,
) -> None:
    """Worker side: compensate, transform, quantise; write slice j into segment j."""
    layout, config, name = item.layout, item.config, item.name
    if layout.padded_numel == layout.numel and config.transform == "none":
        x = item.flat  # NOTE: in place: the caller's tensor is overwritten by the average
    else:
        # NOTE: scratch shared by every tensor's encode and owner stage: they run one after
        # another on the caller's thread; decodes may run on the backend's thread meanwhile,
        # so they have their own (per exchange, see _decode).
        x = state.buffer(("x",), layout.padded_numel, torch.float32, item.flat.device)
        x[: layout.numel].copy_(item.flat)
        x[layout.numel :].zero_()
    rows = x.view(-1, layout.cols)  # (P * rows, cols)
    if config.transform != "none":
        rows = forward_(rows, config.transform, state.signs(name, layout.cols, x.device))
    residual = state.worker.get(name) if error_feedback else None
    part = _part(send, item)
    if config.bits == 32:  # NaN and ±inf travel as they are
        if residual is not None:
            rows.add_(residual.view_as(rows))
        part.view(torch.float32).copy_(rows.view(layout.world_size, layout.slice_numel))
        return
    error = state.spare("worker", name, layout.padded_numel, x.device) if error_feedback else None
    finite = worker_encode(
        rows,
        part,
        layout,
        config,
        _scratch(state, layout, "stage", x.device),
        residual=residual.view_as(rows) if residual is not None else None,
        error=error.view_as(rows) if error is not None else None,
        generator=_generator(generators, name),
    )
    if error is not None and finite:
        state.worker[name] = error


def _reduce_owned(
    item: _Item,
    state: TwoPhaseState,
    received: torch.Tensor,
    owned: torch.Tensor,
    error_feedback: bool,
    generators: Generators | None,
    *,
    own_rows: torch.Tensor | None,
) -> bool:
    """Owner side: average the P copies of this rank's slice, compensate, re-quantise. The
    re-quantised slice is also decoded into ``own_rows`` when given (this rank's rows of the
    tensor, which the decode writes in place); returns whether it was (given, finite,
    quantised), so that the decode skips this rank's segment.

    NOTE: the decode of one's own segment of the all-gather is then a copy never made: at
    P = 2 half of the decode stage (the same bits: the same dequantisation of the same codes
    and scales, see :func:`~superneurons.codecs.twophase_stages.owner_reduce`)."""
    layout, config, name = item.layout, item.config, item.name
    world_size, device = layout.world_size, received.device
    parts = _part(received, item)
    residual = state.owner.get(name) if error_feedback else None
    out = owned[item.offset : item.offset + layout.slice_bytes].view(1, -1)
    if config.bits == 32:
        copies = state.buffer(("copies",), layout.padded_numel, torch.float32, device)
        copies.view(world_size, -1).copy_(parts.view(torch.float32))
        average = state.buffer(("average",), layout.slice_numel, torch.float32, device)
        torch.sum(copies.view(world_size, layout.slice_numel), dim=0, out=average)
        average.div_(world_size)
        if residual is not None:
            average.add_(residual)
        out.view(torch.float32).copy_(average.view(1, -1))
        return False
    error = state.spare("owner", name, layout.slice_numel, device) if error_feedback else None
    shape = (layout.rows, layout.cols)
    finite = owner_reduce(
        parts,
        out,
        layout,
        config,
        _scratch(state, layout, "stage", device),
        residual=residual.view(shape) if residual is not None else None,
        error=error.view(shape) if error is not None else None,
        generator=_generator(generators, name + "/owner"),
        decoded=own_rows,
    )
    if error is not None and finite:
        state.owner[name] = error
    return finite and own_rows is not None


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
    table: torch.Tensor,
    key: tuple[Any, ...],
    *,
    skip: int | None,
) -> None:
    """Every rank: decode every owner's slice (but ``skip``'s, decoded by the owner's stage),
    undo the transform, write the average."""
    layout, config, name = item.layout, item.config, item.name
    parts, device = _part(table, item), item.flat.device
    in_place = _in_place(item)
    rows = _decode_rows(item, state, key)
    x = rows.view(-1)
    if config.bits == 32:
        x.view(layout.world_size, -1).copy_(parts.view(torch.float32))
    else:
        scratch = _scratch(state, layout, f"decode {key}", device)
        decode_slices(parts, rows, layout, config, scratch, skip=skip)
    if config.transform != "none":
        rows = inverse_(rows, config.transform, state.signs(name, layout.cols, x.device))
    if not in_place:
        item.flat.copy_(rows.reshape(-1)[: layout.numel])
