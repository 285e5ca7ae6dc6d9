"""The LM head's cross-entropy in slices of the *vocabulary*: the head's weight is read one slice
of rows at a time, so a weight that lives on the host visits the device a slice at a time.

:mod:`.headloss` chunks the *tokens*: the logits never exist whole, but every chunk reads the
whole ``(V, H)`` weight and the backward writes a whole ``(V, H)`` gradient. Here the loop runs
over slices ``W[v0:v1]`` of the weight instead, with the online log-sum-exp of Cut
Cross-Entropy (Wijmans et al., ICLR'25) and Liger-Kernel's fused linear cross-entropy
(Hsu et al., 2024); per slice of ``r`` rows and all ``N`` tokens:

* **forward**: ``z = h W_cᵀ`` (``(N, r)``, fp32), the running per-token maximum ``m`` and sum
  ``s = Σ exp(z - m)`` (rescaled when ``m`` grows), and the target's logit where the target
  falls in the slice; the loss is ``Σ (m + log s - z_y)`` over non-ignored tokens, and only
  ``lse = m + log s`` (one float per token) is kept for backward;
* **backward**: each slice's ``z`` recomputed, ``g = (softmax(z) - onehot(y)) · scale``,
  ``dh += g W_c``, and the slice's gradient ``dW_c = gᵀ h`` handed to the weight's
  :class:`RowSource` (one ``(r, H)`` buffer at a time; a source whose weight lives on the
  host writes it there: :mod:`superneurons.memory.offload.slices`).

The slices come from a :class:`RowSource`: :class:`ResidentRows` (the weight on the device: a
slice is a view, the gradient one ``(V, H)`` tensor) or a streamed weight's, which copies each
slice from the host ahead of its use (the next slice is fetched while this one computes).

**Not bitwise** against the unchunked ``F.cross_entropy(h Wᵀ)``: the log-sum-exp is summed
slice by slice (online), so ``lse`` differs in its last bits, and with it every ``g``; ``dh``
sums ``V/r`` partial GEMMs instead of one. Measured on this project's CPU (tests): loss,
``dh`` and ``dW`` within 1e-6 relative (norm of the difference over the norm), as
:mod:`.headloss`'s token chunks. Against itself it is deterministic: the same slices give the
same bits whether the weight is resident or streamed.

:func:`vocab_rows_for` picks the slice from bytes, as :func:`.headloss.chunk_tokens_for` does
for tokens: the largest power of two whose working set (the slice, the next slice being fetched,
the slice's gradient, its fp32 logits) is no larger than the head's input.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch

from superneurons.errors import ConfigError
from superneurons.memory.chunked.headloss import check_head_shapes, mean_over_items

__all__ = [
    "MIN_VOCAB_ROWS",
    "ResidentRows",
    "RowGradient",
    "RowSource",
    "slice_bounds",
    "vocab_cross_entropy",
    "vocab_rows_for",
]

# NOTE: the loop costs ~20 small ops per slice and pass. Measured on this project's CPU (one
# thread, best of 5 process-CPU times on a shared machine; 64 tokens, a 64-wide head, 32k
# vocabulary, forward + backward): 256 rows 92 ms, 512 rows 65 ms, 1024 rows 52 ms, 4096 rows
# 48 ms, the whole weight as one slice 59 ms. A slice of a real head (H = 4096, bf16, 1024
# rows: 8 MiB) is also a copy large enough to run at the host link's bandwidth.
MIN_VOCAB_ROWS = 1024


def vocab_rows_for(n_tokens: int, hidden: int, vocab: int, itemsize: int) -> int:
    """Rows per vocabulary slice: the largest ``2^k`` whose slice working set -- the slice and
    the next one being fetched, the slice's gradient (``3 r H`` elements of ``itemsize``) and
    its fp32 logits (``4 N r`` bytes) -- is no larger than the head's input (``N H`` elements),
    PyTorch's ``aspect_ratio`` rule as :func:`.headloss.chunk_tokens_for` uses it; at least
    :data:`MIN_VOCAB_ROWS`, at most ``V``."""
    if min(n_tokens, hidden, vocab, itemsize) < 1:
        raise ConfigError(
            f"head shape must be positive, got N={n_tokens} H={hidden} V={vocab} "
            f"itemsize={itemsize}"
        )
    per_row = 3 * hidden * itemsize + 4 * n_tokens
    fit = max(n_tokens * hidden * itemsize // per_row, 1)
    return min(max(1 << (fit.bit_length() - 1), MIN_VOCAB_ROWS), vocab)


def slice_bounds(vocab: int, rows: int) -> tuple[tuple[int, int], ...]:
    """``(v0, v1)`` of each slice of ``rows`` rows (the last may be shorter)."""
    if rows < 1:
        raise ConfigError(f"vocab_rows must be >= 1, got {rows}")
    return tuple((v0, min(v0 + rows, vocab)) for v0 in range(0, vocab, rows))


class RowGradient(Protocol):
    """Where the slices' gradients of one backward go."""

    def put(self, v0: int, v1: int, grad: torch.Tensor) -> None:
        """Take ``grad`` (``(v1 - v0, H)``), the gradient of rows ``v0:v1``."""

    def result(self) -> torch.Tensor | None:
        """The weight's whole gradient, once every slice was put (what autograd receives; None:
        the gradient went elsewhere, e.g. to a host optimizer)."""


class RowSource(Protocol):
    """Where a head's weight rows come from, and where their gradient goes."""

    def fetch(self, v0: int, v1: int) -> Any:
        """Start making rows ``v0:v1`` available on the compute device; returns a token."""

    def ready(self, token: Any) -> torch.Tensor:
        """The fetched rows (``(v1 - v0, H)``), usable on the current stream."""

    def gradient(self) -> RowGradient:
        """A fresh gradient for one backward."""


class ResidentRows:
    """The weight on the compute device: a slice is a view of it (read when used, so a window
    that re-points the parameter is followed); the gradient one ``(V, H)`` tensor beside it."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def fetch(self, v0: int, v1: int) -> tuple[int, int]:
        return v0, v1

    def ready(self, token: tuple[int, int]) -> torch.Tensor:
        return self.weight.detach()[token[0] : token[1]]

    def gradient(self) -> RowGradient:
        return _DeviceGradient(torch.empty_like(self.weight, memory_format=torch.contiguous_format))


class _DeviceGradient:
    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad

    def put(self, v0: int, v1: int, grad: torch.Tensor) -> None:
        self.grad[v0:v1].copy_(grad)

    def result(self) -> torch.Tensor:
        return self.grad


def vocab_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_rows: int,
    source: RowSource | None = None,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    num_items: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, over slices of
    ``vocab_rows`` rows of ``weight`` (module docstring).

    Args:
        hidden: ``(N, H)`` hidden states (the GEMMs run in their dtype, the softmax in fp32).
        weight: the ``(V, H)`` output embedding (the parameter: autograd gives it the gradient
            ``source`` assembles; its values are read through ``source``).
        targets: ``(N,)`` int64; ``ignore_index`` marks tokens without a loss.
        vocab_rows: rows per slice (:func:`vocab_rows_for`).
        source: where the rows come from (default: :class:`ResidentRows` of ``weight``).
        bias: ``(V,)`` or None (read on the compute device, sliced as the weight).
        num_items: the denominator (as :func:`.headloss.linear_cross_entropy`); None: the
            non-ignored tokens.

    Returns:
        The fp32 scalar ``sum of token losses / num_items``.
    """
    check_head_shapes(hidden, weight, targets)
    bounds = slice_bounds(int(weight.shape[0]), vocab_rows)
    rows = source if source is not None else ResidentRows(weight)
    total = _VocabSlicedSum.apply(hidden, weight, bias, targets, rows, bounds, ignore_index)
    return mean_over_items(total, targets, ignore_index, num_items)


def _slices(
    source: RowSource, bounds: tuple[tuple[int, int], ...]
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Each slice's rows, the next one fetched before this one is used (two live at most)."""
    pending = source.fetch(*bounds[0])
    for i, (v0, v1) in enumerate(bounds):
        current = pending
        pending = source.fetch(*bounds[i + 1]) if i + 1 < len(bounds) else None
        yield v0, v1, source.ready(current)
        del current


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``(N, r)`` fp32 logits of one slice: the GEMM in the input's dtype, then upcast."""
    z = h @ w.T if b is None else torch.addmm(b, h, w.T)
    return z if z.dtype == torch.float32 else z.float()


def _in_slice(safe: torch.Tensor, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local, inside)``: each target's column in the slice (clamped: gathers stay in range)
    and a float 0/1 mask of the targets the slice holds (no data-dependent op)."""
    inside = (safe >= v0) & (safe < v1)
    return (safe - v0).clamp_(0, v1 - v0 - 1), inside.float()


class _VocabSlicedSum(torch.autograd.Function):
    """Sum of token losses over vocabulary slices; keeps the per-token log-sum-exp and
    recomputes each slice's logits in backward (module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        source: RowSource,
        bounds: tuple[tuple[int, int], ...],
        ignore_index: int,
    ) -> torch.Tensor:
        ignored = targets == ignore_index
        safe, valid = targets.masked_fill(ignored, 0), (~ignored).float()
        n = hidden.shape[0]
        top = torch.full((n,), float("-inf"), dtype=torch.float32, device=hidden.device)
        sumexp = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        picked = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        for v0, v1, w in _slices(source, bounds):
            z = _logits(hidden, w, None if bias is None else bias[v0:v1])  # (N, r)
            local, inside = _in_slice(safe, v0, v1)
            picked.add_(z.gather(1, local.unsqueeze(1)).squeeze(1).mul_(inside))
            grown = torch.maximum(top, z.amax(dim=1))  # (N,)
            sumexp.mul_(top.sub_(grown).exp_()).add_(z.sub_(grown.unsqueeze(1)).exp_().sum(dim=1))
            top = grown
            del z, w
        lse = sumexp.log_().add_(top)  # (N,)
        ctx.save_for_backward(hidden, bias, safe, valid, lse)
        ctx.source, ctx.bounds = source, bounds
        return ((lse - picked) * valid).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, bias, safe, valid, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        source: RowSource = ctx.source
        dh = torch.zeros_like(hidden) if need_h else None
        db = torch.empty_like(bias) if need_b and bias is not None else None
        dw = source.gradient() if need_w else None
        scale = (valid * grad.float()).unsqueeze(1)  # (N, 1): 0 on ignored tokens
        for v0, v1, w in _slices(source, ctx.bounds):
            z = _logits(hidden, w, None if bias is None else bias[v0:v1])  # (N, r)
            local, inside = _in_slice(safe, v0, v1)
            z.sub_(lse.unsqueeze(1)).exp_()  # softmax
            z.scatter_add_(1, local.unsqueeze(1), inside.neg().unsqueeze(1))  # - onehot(y)
            g32 = z.mul_(scale)
            g = g32 if g32.dtype == hidden.dtype else g32.to(hidden.dtype)
            if dh is not None:
                dh.addmm_(g, w)
            if dw is not None:
                dw.put(v0, v1, g.T @ hidden)  # (r, H): one slice's gradient at a time
            if db is not None:
                db[v0:v1] = g32.sum(dim=0).to(db.dtype)
            del z, g32, g, w
        return dh, (dw.result() if dw is not None else None), db, None, None, None, None
