"""PowerSGD across ranks: the two all-reduces, the warm-start factors and error feedback.

Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019 (Algorithm 1 with error feedback and warm start).

Every gradient with two or more dimensions is viewed as a matrix ``M`` of shape
``(shape[0], prod(shape[1:]))``; each rank computes ``P = M Q`` with the shared ``Q`` of the
previous step (warm start), the ranks all-reduce ``P``, orthogonalise it, compute
``Q = Mᵀ P̂``, all-reduce ``Q`` and use ``P̂ Q̄ᵀ`` as the averaged gradient. Tensors where
the factors would not be smaller than the matrix (biases, 1-D norms, tiny matrices) travel
uncompressed in the first all-reduce.

NOTE: unlike ``torch.distributed``'s ``powerSGD_hook``, which issues the second all-reduce
from a future callback and crashed with more than one bucket on gloo
(benchmarks/results/network/README.md), both
all-reduces here are issued from the hook body, in the same order on every rank; only local
work (decompression, storing the warm-start ``Q``) runs in the callback.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from superneurons.codecs.coding.finite import all_finite
from superneurons.codecs.powersgd import PowerSGD, orthogonalize_rows_
from superneurons.ddp.callbacks import then_same_threads

__all__ = ["PowerSGDState", "powersgd_reduce"]


@dataclass
class PowerSGDState:
    """The warm-start factors ``Q`` per parameter name (identical on every rank)."""

    seed: int = 0
    q_by_name: dict[str, torch.Tensor] = field(default_factory=dict)

    def q_for(self, name: str, m: int, rank: int, device: torch.device) -> torch.Tensor:
        """The ``(m, rank)`` warm-start ``Q`` of ``name``; random on first use, seeded by the
        name so every rank draws the same matrix without communicating."""
        q = self.q_by_name.get(name)
        if q is None or q.shape != (m, rank):
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
            q = torch.randn(m, rank, generator=gen).to(device)
            self.q_by_name[name] = q
        return q

    def state_dict(self) -> dict[str, object]:
        return {"seed": self.seed, "q_by_name": {k: v.clone() for k, v in self.q_by_name.items()}}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.seed = int(state["seed"])  # type: ignore[call-overload]
        q_by_name = state["q_by_name"]
        assert isinstance(q_by_name, dict)
        self.q_by_name = {str(k): v.clone() for k, v in q_by_name.items()}


def _orthogonal_rows(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views (r, n) of ``flat``'s leading matrices, orthogonalised by rows per run of equal
    shapes (one batched pass per run)."""
    views: list[torch.Tensor] = []
    start, k = 0, 0
    while k < len(shapes):
        j = k
        while j < len(shapes) and shapes[j] == shapes[k]:
            j += 1
        r, n = shapes[k]
        group = flat[start : start + (j - k) * r * n].view(j - k, r, n)
        orthogonalize_rows_(group)
        views.extend(group.unbind(0))
        start += (j - k) * r * n
        k = j
    return views


_Matrix = tuple[str, torch.Tensor, torch.Tensor, int]  # name, M (n, m), warm-start Q, index


def powersgd_reduce(
    config: PowerSGD,
    state: PowerSGDState,
    pieces: Sequence[tuple[str, torch.Tensor]],
    out: torch.Tensor,
    *,
    residuals: dict[str, torch.Tensor] | None,
    group: dist.ProcessGroup | None,
    world_size: int,
) -> tuple[torch.futures.Future[torch.Tensor], int]:
    """Average ``pieces`` (name, gradient) across ranks by PowerSGD, writing into ``out``.

    ``out`` is the flat concatenation of the pieces (the DDP bucket). ``residuals`` (by name)
    holds the error feedback, updated in place from finite values only; None disables it.
    NOTE: float32 contiguous gradients are used as scratch (the residual is added into them),
    as the DDP bucket is overwritten with the average anyway.
    Returns a future completed with ``out`` and the bytes this rank sent.
    """
    offsets = [0]
    for _, grad in pieces:
        offsets.append(offsets[-1] + grad.numel())
    mats, dense, compensated = _matrices(config, state, pieces, residuals)
    first, pts, locally_finite = _first_reduce(mats, dense, compensated, group)
    cursor = sum(pt.numel() for pt in pts)
    for i in dense:
        size = compensated[i].numel()
        out[offsets[i] : offsets[i + 1]].copy_(first[cursor : cursor + size] / world_size)
        cursor += size
        if residuals is not None:
            residuals.pop(pieces[i][0], None)  # sent exactly: no residual
    finite = all_finite(first)
    p_hats, qts, second, work, locally_finite = _second_reduce(
        mats, pts, first, out, group, locally_finite
    )
    if residuals is not None and locally_finite:
        _keep_errors(mats, p_hats, qts, residuals)

    def finish(_: object = None) -> torch.Tensor:
        start = 0
        for (name, mat, _, index), p_hat, qt in zip(mats, p_hats, qts, strict=True):
            qt_avg = second[start : start + qt.numel()].view_as(qt) / world_size
            start += qt.numel()
            torch.mm(p_hat, qt_avg, out=out[offsets[index] : offsets[index + 1]].view_as(mat))
            if finite and bool(torch.isfinite(qt_avg).all()):
                state.q_by_name[name] = qt_avg.t()  # warm start (NaN never stored), (m, r)
        return out

    bytes_sent = (first.numel() + second.numel()) * 4
    if work is None:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(finish())
        return fut, bytes_sent
    return then_same_threads(work.get_future(), finish), bytes_sent


def _matrices(
    config: PowerSGD,
    state: PowerSGDState,
    pieces: Sequence[tuple[str, torch.Tensor]],
    residuals: dict[str, torch.Tensor] | None,
) -> tuple[list[_Matrix], list[int], list[torch.Tensor]]:
    """Every piece compensated (``+ residual``), and the matrices among them with their
    warm-start ``Q``, in the shape order the first all-reduce lays them out; the indices of
    the pieces that travel uncompressed."""
    mats: list[_Matrix] = []
    dense: list[int] = []
    compensated: list[torch.Tensor] = []
    for index, (name, grad) in enumerate(pieces):
        # NOTE: in place in the gradient (the DDP bucket, overwritten with the average), so a
        # step allocates nothing gradient-sized: bitwise the same as ``grad + residual``.
        value = grad if grad.dtype == torch.float32 and grad.is_contiguous() else grad.float()
        if residuals is not None and name in residuals:
            value.add_(residuals[name].view_as(value))
        compensated.append(value)
        matrix = config.matrix_shape(grad.shape)
        if matrix is None:
            dense.append(index)
        else:
            n, m = matrix
            r = min(config.rank, n, m)
            mats.append((name, value.view(n, m), state.q_for(name, m, r, grad.device), index))
    # Pᵀs of equal shape side by side, so after the sum each group is one (g, r, n) view of
    # the message and is orthogonalised in one batched pass (no copy back, no per-matrix
    # Python: 21 matrices in 5 groups on the ResNet). The order depends on shapes only: the
    # same on every rank.
    order = sorted(range(len(mats)), key=lambda k: (mats[k][2].shape[1], mats[k][1].shape[0], k))
    return [mats[k] for k in order], dense, compensated


def _first_reduce(
    mats: list[_Matrix],
    dense: list[int],
    compensated: list[torch.Tensor],
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, list[torch.Tensor], bool]:
    """First all-reduce: every Pᵀ (r, n) and the uncompressed tensors, in one flat message.
    Returns it (summed), the local Pᵀs and whether this rank's P was finite."""
    # NOTE on layouts (one core, fc-heavy's 2048 x 12544 M): ``Qᵀ Mᵀ`` with Qᵀ stored as
    # (r, m) rows takes 15 ms against 34 ms for ``M @ Q``, so Q travels and is kept as Qᵀ rows
    # (``q_by_name`` holds the (m, r) transposed view). ``M @ Qᵀ.t()`` is faster still but
    # MKL's result then depends on M's address modulo 16 bytes, i.e. on DDP's bucket layout,
    # which would break bitwise resume; these products were checked not to.
    pts = [torch.mm(q.t().contiguous(), mat.t()) for _, mat, q, _ in mats]
    first = torch.cat([pt.reshape(-1) for pt in pts] + [compensated[i].reshape(-1) for i in dense])
    p_numel = sum(pt.numel() for pt in pts)
    # Checked before the sum, on this rank's P only (small): M holds NaN/Inf exactly when its
    # P = M Q does, so a residual is updated from finite values only (as before).
    locally_finite = all_finite(first[:p_numel])
    if first.numel():
        dist.all_reduce(first, group=group)
    return first, pts, locally_finite


def _second_reduce(
    mats: list[_Matrix],
    pts: list[torch.Tensor],
    first: torch.Tensor,
    out: torch.Tensor,
    group: dist.ProcessGroup | None,
    locally_finite: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, Any, bool]:
    """Second all-reduce: ``Qᵀ = P̂ᵀ M`` (r, m) of every matrix, issued here (not from a
    callback), asynchronous. Returns ``(P̂s, local Qᵀs, the message, its Work or None,
    whether this rank's factors were finite)``."""
    # NOTE: ``M.t() @ P̂`` was 18x slower on one core for fc-heavy's M (0.37 vs 0.02 s).
    p_hats = [pt.t() for pt in _orthogonal_rows(first, [pt.shape for pt in pts])]  # (n, r)
    qts = [torch.mm(p_hat.t(), mat) for (_, mat, _, _), p_hat in zip(mats, p_hats, strict=True)]
    second = torch.cat([qt.reshape(-1) for qt in qts]) if qts else out.new_empty(0)
    locally_finite = locally_finite and all_finite(second)  # before the sum overwrites it
    work = dist.all_reduce(second, group=group, async_op=True) if qts else None
    return p_hats, qts, second, work, locally_finite


def _keep_errors(
    mats: list[_Matrix],
    p_hats: list[torch.Tensor],
    qts: list[torch.Tensor],
    residuals: dict[str, torch.Tensor],
) -> None:
    """error = M − P̂ Q_localᵀ (the paper's local decompression), written into the old
    residual's storage (M already holds it) or a new tensor: one pass, no temporary."""
    for (name, mat, _, _), p_hat, qt in zip(mats, p_hats, qts, strict=True):
        old = residuals.get(name)
        if old is not None and old.numel() == mat.numel() and old.is_contiguous():
            torch.addmm(mat, p_hat, qt, alpha=-1, out=old.view_as(mat))
        else:
            residuals[name] = torch.addmm(mat, p_hat, qt, alpha=-1).reshape(-1)
