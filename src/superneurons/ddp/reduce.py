"""One bucket averaged across ranks, each parameter by its own route, collectives in fixed order.

A route is ``None`` (plain fp32 all-reduce: ``dense``, warm-up), a summable codec (identity,
fp16, bf16: cast and all-reduce), :class:`PowerSGD` (its two all-reduces), or a gathered codec
(fixed-size payloads, all-gathered, ``decode_sum``). Embeddings under ``rowsparse(...)`` may
travel as rows + indices instead (see :mod:`.rowsparse`). A bucket whose parameters take
different routes (``auto``) issues, on every rank in the same order: the row-count all-reduce
(row-sparse only), the fp32 all-reduce, one all-reduce per cast codec (sorted by spec),
PowerSGD's two all-reduces, the two-phase routes' all-to-all and all-gather (every
:class:`TwoPhase` parameter in one message, in waves where it is large, see :mod:`.twophase`), then ONE all-gather for
every gathered payload and row block.

Hook overhead, what this module does to keep it low (``benchmarks/hook_overhead.py``,
``benchmarks/results/hook_overhead/``):

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

import typing
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from superneurons.codecs.codec import Codec, Payload, decode_mean_into, subtract_decode
from superneurons.codecs.coding.finite import all_finite
from superneurons.codecs.powersgd import PowerSGD
from superneurons.codecs.twophase import TwoPhase
from superneurons.compat import all_gather_into_tensor
from superneurons.ddp.bucket import Piece, Route, pieces_of
from superneurons.ddp.callbacks import then_same_threads
from superneurons.ddp.powersgd import PowerSGDState, powersgd_reduce
from superneurons.ddp.rowblocks import RowBlock, decide_rows, gather_row_counts
from superneurons.ddp.state import CompressionState, WireBuffers
from superneurons.ddp.twophase_route import release_twophase, twophase_reduce

__all__ = ["reduce_bucket"]

Future = torch.futures.Future[torch.Tensor]

_ALIGN = 16  # bytes: codecs view payload bytes as wider types (float32, int64)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _lossless(route: Route) -> bool:
    return route is None or (
        not isinstance(route, PowerSGD | TwoPhase) and route.spec == "identity"
    )


def _kind(route: Route) -> str:
    """``dense`` | ``cast`` | ``lowrank`` | ``twophase`` | ``gathered``.

    NOTE: a route is None, a :class:`PowerSGD` or a codec, so it is told apart by concrete
    checks: ``isinstance(route, Codec)`` on the runtime-checkable protocol cost 17 ms per step
    on the ResNet's 62 parameters (cProfile, rank 0, 100 Mbit/s).
    """
    if route is None or _lossless(route):
        return "dense"
    if isinstance(route, PowerSGD):
        return "lowrank"
    if isinstance(route, TwoPhase):
        return "twophase"
    return "cast" if route.summable else "gathered"


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

    if state.twophase is not None and state.twophase.configs:  # a route left two-phase
        release_twophase(
            state, pieces, [i for i, r in enumerate(routes) if not isinstance(r, TwoPhase)]
        )
    rows: list[RowBlock] = []
    if state.pipeline.row_sparse:
        rows = decide_rows(state, pieces, routes, gather_row_counts(state, pieces))
    in_rows = {block.index for block in rows}
    if rows and state.twophase is not None:
        release_twophase(state, pieces, sorted(in_rows))

    kinds = [_kind(r) if i not in in_rows else "rows" for i, r in enumerate(routes)]
    # 1. plain fp32 all-reduce (dense routes, identity)
    dense = [i for i, k in enumerate(kinds) if k == "dense"]
    if dense:
        futures.append(_dense_reduce(state, buffer, [pieces[i] for i in dense], finishers))

    # 2. one all-reduce per cast codec, in spec order
    casts: dict[str, list[int]] = {}
    for i, route in enumerate(routes):
        if kinds[i] == "cast":
            casts.setdefault(typing.cast(Codec, route).spec, []).append(i)
    for spec in sorted(casts):
        codec = typing.cast(Codec, routes[casts[spec][0]])
        chosen = [pieces[i] for i in casts[spec]]
        futures.append(_cast_reduce(state, buffer, codec, chosen, finishers))

    # 3. PowerSGD's two all-reduces
    low_rank = [i for i, k in enumerate(kinds) if k == "lowrank"]
    if low_rank:
        futures.append(_powersgd(state, buffer, routes, [pieces[i] for i in low_rank], low_rank))

    # 4. the two-phase routes: per wave ONE all-to-all (waited for), ONE all-gather
    two = [i for i, k in enumerate(kinds) if k == "twophase"]
    if two:
        defer = not bucket.is_last()  # its all-gather waits for the next bucket's hook
        futures.append(twophase_reduce(state, pieces, routes, two, finishers, defer=defer))

    # 5. one all-gather: every gathered payload and row block
    gathered = [i for i, k in enumerate(kinds) if k == "gathered"]
    if gathered or rows:
        futures.append(_gathered_reduce(state, buffer, pieces, routes, gathered, rows, finishers))

    def finish(_: object) -> torch.Tensor:
        for done in finishers:
            done()
        return buffer

    if len(futures) == 1 and not finishers:  # one collective, nothing to scatter: one callback
        return then_same_threads(futures[0], lambda _: buffer)
    return then_same_threads(torch.futures.collect_all(futures), finish)  # type: ignore[arg-type]


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
    """A summable cast codec: ``encode(compensated / P)``, one all-reduce, decode in place.

    NOTE (the gap to PyTorch's ``fp16_compress_hook``): no tensor is allocated per
    step. The division and the cast are one pass into a wire buffer kept per bucket signature
    (``torch.div(..., out=fp16)`` computes in float32 and rounds once: bitwise the same as
    ``encode(c / P)``); the error-feedback residual ``c - decode(payload) · P`` is written into
    the one of two residual slabs that does not hold the current residual (so a non-finite step
    keeps the old one); the average is cast straight into the bucket.
    """
    world_size = state.world_size
    whole = sum(p.flat.numel() for p in pieces) == buffer.numel() and buffer.dtype == torch.float32
    flats = [_compensate(state, piece) for piece in pieces]
    compensated = buffer if whole else torch.cat(flats)
    wire_dtype = getattr(codec, "wire_dtype", None)  # cast codecs name it; else ask encode
    if not isinstance(wire_dtype, torch.dtype):
        wire_dtype = codec.encode(compensated[:1]).data.dtype
    key = (codec.spec, *(piece.name for piece in pieces))
    numel, device = compensated.numel(), buffer.device
    wire = state.kept(("wire", *key), numel, wire_dtype, device)
    # Divide before encoding, as DDP does, so fp16 sums cannot overflow. NOTE: two passes
    # through a float32 scratch; ``torch.div(..., out=fp16)`` takes a slow casting loop
    # (25.7M elements, one core: 79 ms against 18 ms).
    scaled = state.kept(("scaled", *key), numel, torch.float32, device)
    wire.copy_(torch.div(compensated, world_size, out=scaled))
    # NOTE: under auto, cast routes go without error feedback: their rounding error (<= 2**-8
    # relative) is not worth three passes per step, and the cost model that chose them
    # (strategy.measure_codecs) timed the cast alone.
    if state.pipeline.error_feedback and state.auto is None:
        error = state.spare_slab(key, pieces, compensated.numel(), buffer.device)
        error.copy_(wire)  # decode: exact widening to float32
        # c - decode · P (one rounding; the same as mul then sub when P is a power of two)
        torch.sub(compensated, error, alpha=world_size, out=error)
        if all_finite(error):
            for piece, part in zip(
                pieces, error.split([p.flat.numel() for p in pieces]), strict=True
            ):
                _store_residual(state, piece.name, part)
    else:  # a residual added above (a route that changed) is sent now: none remains
        for piece in pieces:
            state.residuals.pop(piece.name, None)
    state.count(sent_bytes=wire.numel() * wire.element_size(), dense_bytes=0)
    work = dist.all_reduce(wire, group=state.process_group, async_op=True)

    def decode() -> None:
        if whole:
            buffer.copy_(wire)  # decode and write in one pass
            return
        for piece, part in zip(pieces, wire.split([p.flat.numel() for p in pieces]), strict=True):
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


def _finite(codec: Codec, payload: Payload, encoded: torch.Tensor) -> bool:
    """Whether ``encoded`` (what made ``payload``) is all finite: read from the payload where
    the codec records it exactly (``payload_finite``: no pass over the values), else one
    min/max pass."""
    recorded = getattr(codec, "payload_finite", None)
    if recorded is not None:
        return bool(recorded(payload))
    return all_finite(encoded)


def _corrected(state: CompressionState, piece: Piece, spec: str) -> torch.Tensor:
    """``grad + residual`` as flat contiguous fp32 for a gathered route. Under error feedback it
    is written into the one of two kept slabs that does not hold the residual (one pass, and
    the old residual survives a non-finite step); the codec then subtracts its decode from it
    in place, so the slab becomes the new residual with no decode-sized temporary. Without
    error feedback it is the bucket's own slice (fp32) or a float copy."""
    flat = piece.flat
    if not state.pipeline.error_feedback:
        return flat if flat.dtype == torch.float32 else flat.float()
    slab = state.spare_slab(("gathered", spec, piece.name), [piece], flat.numel(), flat.device)
    residual = state.residuals.get(piece.name)
    if residual is not None and residual.numel() == flat.numel():
        if flat.dtype == torch.float32:
            torch.add(flat, residual, out=slab)  # g + r: the bits of the in-place sum
        else:
            slab.copy_(flat).add_(residual)
    else:
        slab.copy_(flat)
    return slab


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
    codecs = {i: typing.cast(Codec, routes[i]) for i in gathered}
    compensated = {i: _corrected(state, pieces[i], codecs[i].spec) for i in gathered}
    payloads: dict[int, Payload] = {}
    for i in gathered:
        generator = state.generator_for(pieces[i].name)
        payloads[i] = codecs[i].encode(compensated[i], generator=generator)
    finite = all(_finite(codecs[i], payloads[i], compensated[i]) for i in gathered)
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
        for i in gathered:  # the slab holds g + r: minus the decode, it is the new residual
            state.residuals[pieces[i].name] = subtract_decode(
                codecs[i], payloads[i], compensated[i]
            )

    def decode() -> None:
        table = received.view(world_size, message_bytes)
        if bool(table[:, flag_at].any()):
            buffer.fill_(float("nan"))
            return
        for slot, i in enumerate(gathered):
            start, width, numel = offsets[slot], widths[slot], payloads[i].numel
            dtype = payloads[i].data.dtype  # aligned slices: viewing as a wider type is legal
            received_payloads = [
                Payload(row[start : start + width].view(dtype), numel) for row in table
            ]
            decode_mean_into(codecs[i], received_payloads, pieces[i].flat, world_size)
        for slot, block in enumerate(rows, start=len(gathered)):
            start, width = offsets[slot], widths[slot]
            block.decode_sum([row[start : start + width] for row in table], pieces[block.index])

    finishers.append(decode)
    return work.get_future()  # type: ignore[no-any-return]
