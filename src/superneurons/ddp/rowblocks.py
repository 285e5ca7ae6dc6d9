"""Row blocks: how :class:`~superneurons.codecs.rowsparse.RowSparse` embeddings travel.

An embedding gradient of ``rows x cols`` whose ranks touch at most ``k`` rows (agreed by an
all-reduce MAX) is sent as ``k`` int64 row indices and ``k x cols`` fp32 rows, divided by the
world size before the sum as DDP does, inside the bucket's one all-gather; the receiver adds
every rank's rows into zeros in rank order. The choice against the parameter's own route
compares the bytes each rank receives (see :func:`decide_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from superneurons.codecs.codec import Codec
from superneurons.codecs.powersgd import PowerSGD
from superneurons.codecs.twophase import TwoPhase
from superneurons.ddp.bucket import Piece, Route

if TYPE_CHECKING:
    from superneurons.ddp.state import CompressionState

__all__ = ["RowBlock", "decide_rows", "gather_row_counts"]


@dataclass(frozen=True)
class RowBlock:
    """One embedding sent as ``k`` (row index, row) pairs, padded with index 0 and zero rows
    (adding ``+0.0`` to a row leaves it unchanged)."""

    index: int  # the parameter's position in the bucket
    k: int  # rows per rank, the MAX over ranks
    cols: int

    @property
    def nbytes(self) -> int:
        return self.k * 8 + self.k * self.cols * 4

    def encode(self, piece: Piece, state: CompressionState) -> torch.Tensor:
        """This rank's rows of ``grad (+ residual)`` divided by the world size, as bytes."""
        flat = piece.flat if piece.flat.dtype == torch.float32 else piece.flat.float()
        residual = state.residuals.pop(piece.name, None)
        if residual is not None:  # rows are exact: what was owed is sent, nothing remains
            flat.add_(residual)
        matrix = flat.view(-1, self.cols)  # (rows, cols)
        touched = matrix.ne(0).any(dim=1).nonzero().reshape(-1)  # (c,)
        count = touched.numel()
        out = torch.zeros(self.nbytes, dtype=torch.uint8, device=flat.device)
        indices = out[: self.k * 8].view(torch.int64)
        values = out[self.k * 8 :].view(torch.float32).view(self.k, self.cols)
        indices[:count] = touched
        # NOTE: divided before the sum, as DDP's all-reduce does: bitwise equal for 2 ranks.
        torch.div(matrix.index_select(0, touched), state.world_size, out=values[:count])
        return out

    def decode_sum(self, received: list[torch.Tensor], piece: Piece) -> None:
        """Write the average of every rank's rows into ``piece`` (zeros elsewhere)."""
        target = piece.flat.view(-1, self.cols)
        target.zero_()
        for data in received:  # rank order: the same sum on every rank
            indices = data[: self.k * 8].view(torch.int64)
            values = data[self.k * 8 :].view(torch.float32).view(self.k, self.cols)
            target.index_add_(0, indices, values.to(target.dtype))


def _touched_rows(piece: Piece, residual: torch.Tensor | None, cols: int) -> int:
    touched = piece.flat.view(-1, cols).ne(0).any(dim=1)
    if residual is not None:
        touched |= residual.view(-1, cols).ne(0).any(dim=1)
    return int(touched.sum())


def gather_row_counts(state: CompressionState, pieces: Sequence[Piece]) -> dict[int, int]:
    """Bucket position -> rows touched, the MAX over ranks, for every embedding in ``pieces``.

    Collective when the bucket holds an embedding (one all-reduce; the set of embeddings is the
    same on every rank, so every rank issues it or none does).
    """
    candidates = [i for i, piece in enumerate(pieces) if piece.name in state.embedding_names]
    if not candidates:
        return {}
    counts = []
    for i in candidates:
        piece = pieces[i]
        cols = math.prod(piece.shape[1:])
        counts.append(_touched_rows(piece, state.residuals.get(piece.name), cols))
    agreed = torch.tensor(counts, dtype=torch.int64, device=pieces[0].flat.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=state.process_group)
    return dict(zip(candidates, (int(k) for k in agreed.tolist()), strict=True))


def _route_volume(route: Route, piece: Piece, world_size: int) -> float:
    """Bytes a rank receives for ``piece`` on ``route`` (ring all-reduce: 2(P−1)/P·S;
    all-gather: (P−1)·S)."""
    ring = 2 * (world_size - 1) / world_size
    if route is None:
        return ring * piece.flat.numel() * 4
    if isinstance(route, PowerSGD):
        return ring * route.payload_bytes([piece.shape])
    if isinstance(route, TwoPhase):  # (P - 1) slices in the all-to-all, (P - 1) in the gather
        return 2 * (world_size - 1) * route.layout(piece.flat.numel(), world_size).slice_bytes
    if isinstance(route, Codec):
        size = route.payload_bytes(piece.flat.numel())
        return ring * size if route.summable else (world_size - 1) * size
    return float("inf")


def decide_rows(
    state: CompressionState,
    pieces: Sequence[Piece],
    routes: Sequence[Route],
    counts: dict[int, int],
) -> list[RowBlock]:
    """Embeddings whose rows + indices are smaller on the wire than their route (the same
    decision on every rank: it depends only on the agreed counts)."""
    blocks = []
    for i, k in counts.items():
        piece = pieces[i]
        cols = math.prod(piece.shape[1:])
        block = RowBlock(i, max(k, 1), cols)
        volume = (state.world_size - 1) * block.nbytes
        if volume < _route_volume(routes[i], piece, state.world_size):
            blocks.append(block)
    return blocks
