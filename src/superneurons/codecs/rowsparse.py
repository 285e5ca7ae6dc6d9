"""Row-sparse gradients (Parallax, Kim et al., EuroSys'19): embeddings travel as rows + indices.

An embedding's gradient touches only the rows of the tokens in the batch. Parallax sends such
"sparse variables" as (indices, rows) and the dense ones by all-reduce. :class:`RowSparse`
wraps any compression: every 2-D parameter of an ``nn.Embedding``/``nn.EmbeddingBag`` whose
gradient has few non-zero rows is all-gathered as ``(row indices, rows)`` — exact fp32 values,
so the average equals dense all-reduce (bitwise for two ranks: ``a + b`` is commutative) — when
that is smaller than what ``inner`` would send for it; everything else goes to ``inner``.

The decision must be the same on every rank, and the row count differs per rank, so the
exchange is: one all-reduce MAX of the row counts of the bucket's embeddings (k), then, for
embeddings where ``world_size · k · (cols + 1) · 4`` bytes beat the dense all-reduce's
``2 · (P−1)/P · rows · cols · 4`` (or what ``inner`` would send), one all-gather of fixed-size messages padded to ``k`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from superneurons.codecs.canonical import Canonical
from superneurons.codecs.codec import Specced

__all__ = ["RowSparse"]


@dataclass(frozen=True)
class RowSparse(Canonical):
    """Embedding gradients as rows + indices when smaller (spec ``rowsparse(INNER)``)."""

    inner: Specced
    NAME: ClassVar[str] = "rowsparse"
