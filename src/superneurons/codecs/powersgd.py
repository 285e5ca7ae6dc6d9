"""PowerSGD's configuration and its arithmetic: rank-r compression by power iteration.

Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019 (Algorithm 1 with error feedback and warm start).

Every gradient with two or more dimensions is viewed as a matrix ``M`` of shape
``(shape[0], prod(shape[1:]))``; tensors where the factors would not be smaller than the matrix
(biases, 1-D norms, tiny matrices) travel uncompressed (:meth:`PowerSGD.matrix_shape`). Not a
codec: its two all-reduces, the warm-start state and the error feedback are the DDP side's
(:mod:`superneurons.ddp.powersgd`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from superneurons.codecs.canonical import Canonical
from superneurons.errors import ConfigError

__all__ = ["PowerSGD", "orthogonalize_", "orthogonalize_rows_"]

# NOTE: guards the Gram-Schmidt division when a column is all zeros (a dead layer); the
# same role as torch's ``orthogonalization_epsilon``.
_ORTHO_EPS = 1e-8


@dataclass(frozen=True)
class PowerSGD(Canonical):
    """Hyper-parameters of PowerSGD: the approximation ``rank`` (r in the paper)."""

    rank: int = 4
    NAME: ClassVar[str] = "powersgd"

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"powersgd: rank must be a positive integer, got {self.rank!r}")

    @property
    def summable(self) -> bool:
        return True

    def matrix_shape(self, shape: Sequence[int]) -> tuple[int, int] | None:
        """``(n, m)`` when a gradient of ``shape`` is compressed, else None (sent dense)."""
        if len(shape) < 2:
            return None
        n, m = int(shape[0]), math.prod(int(s) for s in shape[1:])
        r = min(self.rank, n, m)
        return (n, m) if r * (n + m) < n * m else None

    def payload_bytes(self, shapes: Sequence[Sequence[int]], *, element_bytes: int = 4) -> int:
        """Bytes this rank contributes to the two all-reduces for tensors of ``shapes``."""
        total = 0
        for shape in shapes:
            matrix = self.matrix_shape(shape)
            if matrix is None:
                total += math.prod(int(s) for s in shape)
            else:
                n, m = matrix
                total += min(self.rank, n, m) * (n + m)
        return total * element_bytes


def orthogonalize_(matrix: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``matrix`` (n, r), in place; NaN stays NaN."""
    for i in range(matrix.shape[1]):
        col = matrix[:, i]
        col.div_(col.norm() + _ORTHO_EPS)
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest.sub_(col.unsqueeze(1) * (col @ rest).unsqueeze(0))
    return matrix


def orthogonalize_rows_(rows: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the rows of each matrix of ``rows`` (g, r, n), in place: the batched
    form of :func:`orthogonalize_` on the transposes (equal up to float32 rounding)."""
    r = rows.shape[1]
    for i in range(r):
        row = rows[:, i : i + 1, :]  # (g, 1, n)
        row.div_(torch.linalg.vector_norm(row, dim=2, keepdim=True) + _ORTHO_EPS)
        if i + 1 < r:
            rest = rows[:, i + 1 :, :]  # (g, r-i-1, n)
            rest.sub_(torch.bmm(rest, row.transpose(1, 2)) * row)
    return rows
