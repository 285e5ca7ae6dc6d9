"""One bucket averaged across ranks, each parameter by its own route, collectives in fixed order.

A route is ``None`` (plain fp32 all-reduce: ``dense``, warm-up), a summable codec (identity,
fp16, bf16: cast and all-reduce), :class:`PowerSGD` (its two all-reduces), or a gathered codec
(fixed-size payloads, all-gathered, ``decode_sum``). Embeddings under ``rowsparse(...)`` may
travel as rows + indices instead (see :mod:`.rowsparse`). A bucket whose parameters take
different routes (``auto``) issues, on every rank in the same order: the row-count all-reduce
(row-sparse only), the fp32 all-reduce, one all-reduce per cast codec (sorted by spec),
PowerSGD's two all-reduces, then ONE all-gather for every gathered payload and row block.

Hook overhead (issue 11 item 3), what this module does to keep it low:

* error feedback works in place: the residual is added into the bucket's own buffer (which is
  overwritten with the average anyway) and the new residual is written into the old one's
  storage, so a step allocates no gradient-sized tensors for it (fresh 100 MB tensors cost
  page faults: half the hook's CPU time on fc-heavy was system time);
* payloads are copied once into a pre-allocated, 16-byte aligned send buffer kept per bucket
  signature, and received payloads are decoded from aligned views (no ``torch.cat``, no clone);
* the average is written by ``torch.div(..., out=bucket slice)``, not divided then copied.

Each is the same arithmetic as before, so results are bitwise unchanged (tested against a
straightforward reference in ``tests/test_hook_compose.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from superneurons.compat import all_gather_into_tensor
from superneurons.compress.bucket import Piece, Route, pieces_of
from superneurons.compress.codec import Codec, Payload, all_finite
from superneurons.compress.hookstate import CompressionState, WireBuffers
from superneurons.compress.powersgd import PowerSGD, PowerSGDState, powersgd_reduce
from superneurons.compress.rowblocks import RowBlock, decide_rows, gather_row_counts

__all__ = ["reduce_bucket"]

Future = torch.futures.Future[torch.Tensor]

_ALIGN = 16  # bytes: codecs view payload bytes as wider types (float32, int64)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _lossless(route: Route) -> bool:
    return route is None or (isinstance(route, Codec) and route.spec == "identity")


def _compensate(state: CompressionState, piece: Piece) -> torch.Tensor:
    """``grad + residual`` as flat fp32: in place in the bucket buffer when it is fp32."""
    residual = state.residuals.get(piece.name) if state.pipeline.error_feedback else None
    flat = piece.flat if piece.flat.dtype == torch.float32 else piece.flat.float()
    if residual is not None:
        flat.add_(residual)  # g + r, bitwise the same as the out-of-place sum
    return flat


def _store_residual(state: CompressionState, name: str, error: torch.Tensor) -> None:
    state.residuals[name] = error


def reduce_bucket(
    state: CompressionState,
    bucket: dist.GradBucket,
    routes: Sequence[Route],
    *,
    codecs_for_step: Sequence[Codec] | None = None,
) -> Future:
    """Average ``bucket`` across ranks, parameter ``i`` by ``routes[i]`` (see the module docs).

    ``codecs_for_step`` overrides the gathered routes' codecs for this step (a θ schedule).
    """
    buffer = bucket.buffer()
    _group, _world_size = state.process_group, state.world_size
    pieces = pieces_of(state.names_by_param, bucket)
    state.count(sent_bytes=0, dense_bytes=buffer.numel() * 4)
    routes = list(routes)
    if codecs_for_step is not None:
        routes = list(codecs_for_step)
    futures: list[Future] = []
    finishers: list[Callable[[], None]] = []

    rows: list[RowBlock] = []
    if state.pipeline.row_sparse:
        rows = decide_rows(state, pieces, routes, gather_row_counts(state, pieces))
    in_rows = {block.index for block in rows}

    # 1. plain fp32 all-reduce (dense routes, identity)
    dense = [i for i, r in enumerate(routes) if _lossless(r) and i not in in_rows]
    if dense:
        futures.append(_dense_reduce(state, buffer, [pieces[i] for i in dense], finishers))

    # 2. one all-reduce per cast codec, in spec order
    casts: dict[str, list[int]] = {}
    for i, route in enumerate(routes):
        if (
            isinstance(route, Codec)
            and route.summable
            and not _lossless(route)
            and i not in in_rows
        ):
            casts.setdefault(route.spec, []).append(i)
    for spec in sorted(casts):
        codec = routes[casts[spec][0]]
        assert isinstance(codec, Codec)
        chosen = [pieces[i] for i in casts[spec]]
        futures.append(_cast_reduce(state, buffer, codec, chosen, finishers))

    # 3. PowerSGD's two all-reduces
    low_rank = [i for i, r in enumerate(routes) if isinstance(r, PowerSGD) and i not in in_rows]
    if low_rank:
        futures.append(_powersgd(state, buffer, routes, [pieces[i] for i in low_rank], low_rank))

    # 4. one all-gather: every gathered payload and row block
    gathered = [
        i
        for i, r in enumerate(routes)
        if isinstance(r, Codec) and not r.summable and i not in in_rows
    ]
    if gathered or rows:
        futures.append(_gathered_reduce(state, buffer, pieces, routes, gathered, rows, finishers))

    def finish(_: object) -> torch.Tensor:
        for done in finishers:
            done()
        return buffer

    if len(futures) == 1 and not finishers:  # one collective, nothing to scatter: one callback
        return futures[0].then(lambda _: buffer)
    return torch.futures.collect_all(futures).then(finish)  # type: ignore[arg-type]


def _dense_reduce(
    state: CompressionState,
    buffer: torch.Tensor,
    pieces: list[Piece],
    finishers: list[Callable[[], None]],
) -> Future:
    """fp32 all-reduce of ``pieces`` (divided by the world size first, as DDP does)."""
    world_size = state.world_size
    for piece in pieces:
        if piece.name in state.residuals:  # a parameter switched to dense: send what it owes
            _compensate(state, piece)
            del state.residuals[piece.name]
    if sum(p.flat.numel() for p in pieces) == buffer.numel():
        message = buffer.div_(world_size)
    else:
        message = torch.cat([p.flat for p in pieces]).div_(world_size)

        def scatter() -> None:
            for piece, part in zip(
                pieces, message.split([p.flat.numel() for p in pieces]), strict=True
            ):
                piece.flat.copy_(part)

        finishers.append(scatter)
    state.count(sent_bytes=message.numel() * message.element_size(), dense_bytes=0)
    work = dist.all_reduce(message, group=state.process_group, async_op=True)
    return work.get_future()  # type: ignore[no-any-return]


def _cast_reduce(
    state: CompressionState,
    buffer: torch.Tensor,
    codec: Codec,
    pieces: list[Piece],
    finishers: list[Callable[[], None]],
) -> Future:
    """A summable cast codec: ``encode(compensated / P)``, one all-reduce, decode in place."""
    world_size = state.world_size
    whole = sum(p.flat.numel() for p in pieces) == buffer.numel() and buffer.dtype == torch.float32
    flats = [_compensate(state, piece) for piece in pieces]
    compensated = buffer if whole else torch.cat(flats)
    # Divide before encoding, as DDP does, so fp16 sums cannot overflow; into a buffer kept
    # per bucket signature (cast codecs return a fresh payload, so it is free again at once).
    key = (codec.spec, *(piece.name for piece in pieces))
    scaled = state.scratch.get(key)
    if scaled is None or scaled.shape != compensated.shape or scaled.device != buffer.device:
        scaled = state.scratch[key] = torch.empty_like(compensated)
    payload = codec.encode(torch.div(compensated, world_size, out=scaled))
    # NOTE: under auto, cast routes go without error feedback: their rounding error (<= 2**-8
    # relative) is not worth a decode and three passes per step, and the cost model that chose
    # them (strategy.measure_codecs) timed the cast alone.
    if state.pipeline.error_feedback and state.auto is None:
        error = codec.decode(payload)  # a fresh float32 tensor
        torch.sub(compensated, error.mul_(world_size), out=error)  # c - decode · P, in place
        if all_finite(error):
            for piece, part in zip(
                pieces, error.split([p.flat.numel() for p in pieces]), strict=True
            ):
                _store_residual(state, piece.name, part)
    else:  # a residual added above (a route that changed) is sent now: none remains
        for piece in pieces:
            state.residuals.pop(piece.name, None)
    wire = payload.data.reshape(-1)
    state.count(sent_bytes=wire.numel() * wire.element_size(), dense_bytes=0)
    work = dist.all_reduce(wire, group=state.process_group, async_op=True)

    def decode() -> None:
        averaged = codec.decode(Payload(wire, wire.numel()))
        if whole:
            buffer.copy_(averaged)
            return
        for piece, part in zip(
            pieces, averaged.split([p.flat.numel() for p in pieces]), strict=True
        ):
            piece.flat.copy_(part)

    finishers.append(decode)
    return work.get_future()  # type: ignore[no-any-return]


def _powersgd(
    state: CompressionState,
    buffer: torch.Tensor,
    routes: list[Route],
    pieces: list[Piece],
    indices: list[int],
) -> Future:
    config = routes[indices[0]]
    assert isinstance(config, PowerSGD)
    if state.powersgd is None:
        state.powersgd = PowerSGDState(seed=state.seed)
    whole = len(pieces) == len(routes)
    out = buffer if whole else buffer.new_empty(sum(p.flat.numel() for p in pieces))
    fut, sent = powersgd_reduce(
        config,
        state.powersgd,
        [(p.name, p.flat.view(p.shape)) for p in pieces],
        out,
        residuals=state.residuals if state.pipeline.error_feedback else None,
        group=state.process_group,
        world_size=state.world_size,
    )
    state.count(sent_bytes=sent, dense_bytes=0)
    if whole:
        return fut

    def scatter(f: Future) -> torch.Tensor:
        done = f.value()
        start = 0
        for piece in pieces:
            piece.flat.copy_(done[start : start + piece.flat.numel()])
            start += piece.flat.numel()
        return buffer

    return fut.then(scatter)


def _gathered_reduce(
    state: CompressionState,
    buffer: torch.Tensor,
    pieces: list[Piece],
    routes: list[Route],
    gathered: list[int],
    rows: list[RowBlock],
    finishers: list[Callable[[], None]],
) -> Future:
    """Encode each gathered parameter; ONE fixed-size all-gather with the row blocks."""
    world_size = state.world_size
    compensated = {i: _compensate(state, pieces[i]) for i in gathered}
    finite = all(all_finite(flat) for flat in compensated.values())
    payloads: dict[int, Payload] = {}
    for i in gathered:
        codec = routes[i]
        assert isinstance(codec, Codec)
        payloads[i] = codec.encode(compensated[i], generator=state.generator_for(pieces[i].name))
    blocks = [block.encode(pieces[block.index], state) for block in rows]
    widths = [payloads[i].nbytes for i in gathered] + [b.numel() for b in blocks]
    offsets = [0]
    for width in widths:
        offsets.append(offsets[-1] + _aligned(width))
    message_bytes = _aligned(offsets[-1] + 1)  # + the non-finite flag byte
    key = tuple(pieces[i].name for i in gathered) + tuple(f"rows:{b.index}" for b in rows)
    wire = state.wires.get(key)
    if wire is None or wire.send.numel() != message_bytes or wire.send.device != buffer.device:
        wire = WireBuffers(
            send=torch.zeros(message_bytes, dtype=torch.uint8, device=buffer.device),
            received=torch.empty(
                world_size * message_bytes, dtype=torch.uint8, device=buffer.device
            ),
        )
        state.wires[key] = wire
    send, received = wire.send, wire.received
    datas = [payloads[i].data.reshape(-1).view(torch.uint8) for i in gathered] + blocks
    for start, width, data in zip(offsets[:-1], widths, datas, strict=True):
        send[start : start + width].copy_(data)
    flag_at = offsets[-1]
    send[flag_at].fill_(0 if finite else 1)
    work = all_gather_into_tensor(received, send, group=state.process_group, async_op=True)
    state.count(sent_bytes=offsets[-1] + 1, dense_bytes=0)
    if state.pipeline.error_feedback and finite:  # computed while the all-gather is in flight
        for i in gathered:
            codec = routes[i]
            assert isinstance(codec, Codec)
            decoded = codec.decode(payloads[i])
            old = state.residuals.get(pieces[i].name)
            if old is not None and old.numel() == decoded.numel() and old.is_contiguous():
                torch.sub(compensated[i], decoded, out=old)
            else:
                state.residuals[pieces[i].name] = compensated[i] - decoded

    def decode() -> None:
        table = received.view(world_size, message_bytes)
        if bool(table[:, flag_at].any()):
            buffer.fill_(float("nan"))
            return
        for slot, i in enumerate(gathered):
            codec = routes[i]
            assert isinstance(codec, Codec)
            start, width, numel = offsets[slot], widths[slot], payloads[i].numel
            dtype = payloads[i].data.dtype  # aligned slices: viewing as a wider type is legal
            received_payloads = [
                Payload(row[start : start + width].view(dtype), numel) for row in table
            ]
            target = pieces[i].flat
            total = codec.decode_sum(received_payloads)
            if target.dtype == total.dtype:
                torch.div(total, world_size, out=target)
            else:
                target.copy_(total / world_size)
        for slot, block in enumerate(rows, start=len(gathered)):
            start, width = offsets[slot], widths[slot]
            block.decode_sum([row[start : start + width] for row in table], pieces[block.index])

    finishers.append(decode)
    return work.get_future()  # type: ignore[no-any-return]
