"""The LM head and its cross-entropy in chunks of tokens: the logits never exist whole.

A language model's output embedding turns ``N`` hidden states ``h`` (``(N, H)``) into
``N x V`` logits ``z = h Wᵀ`` whose cross-entropy is the loss. Eager PyTorch holds the logits,
their fp32 copy, the log-softmax and its gradient: about ``3 x 4·N·V`` bytes (Llama-3-8B at
``T = 8192``: 11.7 GiB), far above any transformer block's working set. Evaluated a chunk of
``c`` tokens at a time, as SuperNeurons' memory-centric recomputation evaluates a segment that
does not fit (Wang et al., PPoPP'18 §3.3), the head holds ``c x V`` logits at a time:

* ``"recompute"``: the forward keeps one float per token (the log-sum-exp ``lse``), not the
  logits; the backward recomputes each chunk's ``z``, ``g = softmax(z) - onehot(y)``,
  ``dh = g W`` and ``dW += gᵀ h`` (one extra GEMM: +33% of the head's FLOPs);
* ``"grad-in-forward"``: the forward computes ``dh`` and ``dW`` as it goes (no extra GEMM) and
  holds them until the backward scales them by the loss's gradient (Liger-Kernel's fused linear
  cross-entropy; PyTorch's chunked op with a scalar reduction).

Three implementations with one contract: ``"native"``, PyTorch's own chunked
``torch.nn.functional.linear_cross_entropy`` (torch >= 2.13; ``reduction="none"`` is its
recompute path, ``"sum"`` its gradient-in-forward path); ``"pure"``, the loop below for
torch versions without it and for bf16 off CUDA, where PyTorch's op upcasts the head's weight
and runs fp32 GEMMs; and ``"exact"`` (recompute only), the loop with the unchunked loss's own
kernels per chunk (``log_softmax`` and its backward, as ``F.cross_entropy`` runs them), so the
hidden states' gradient of every token is the unchunked loss's bit for bit (measured on this
project's CPU, 32k vocabulary: ``native`` differs by 3.5e-7 relative, ``pure`` by 3.8e-8; after
8 AdamW steps of a LoRA fine-tune that became 3-5e-6 in the adapters, and 0 with ``exact``),
for two ``(c, V)`` buffers per chunk instead of one. All compute the GEMMs in the input's dtype
(bf16 GEMMs for bf16 models, fp32 accumulation inside them) and the softmax in fp32, as Hugging
Face's loss does after its ``logits.float()``; none calls a data-dependent op (``nonzero``,
``.item()``), so they run on fake tensors and never synchronise a device. What chunking cannot
keep bitwise is a sum over tokens: the loss's value and the head's own weight gradient
(``dW = Σ gᵀ h``) are summed chunk by chunk (within 1e-6 relative).

:func:`chunk_tokens_for` picks the chunk from bytes: the largest power of two whose logits
chunk is no larger than the head's input, PyTorch's ``aspect_ratio`` rule (a working set the
size of its input, like every other layer's).
"""

from __future__ import annotations

from typing import Any

import torch

from superneurons.compat import native_linear_cross_entropy
from superneurons.errors import ConfigError
from superneurons.memory.plan import HEAD_MODES, IMPLEMENTATIONS

__all__ = [
    "HEAD_MODES",
    "IMPLEMENTATIONS",
    "MIN_CHUNK_TOKENS",
    "check_head_shapes",
    "chunk_tokens_for",
    "linear_cross_entropy",
    "mean_over_items",
    "resolve_implementation",
]

# NOTE: below ~64 rows a chunk's GEMM is launch- and loop-bound (the Python loop costs ~20 ops
# per chunk); 64 keeps a 32k-vocabulary head on this project's CPU within 10% of one GEMM.
MIN_CHUNK_TOKENS = 64


def chunk_tokens_for(n_tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: ``2^k <= N·H / V`` (a chunk's logits no larger than the head's input,
    PyTorch's ``aspect_ratio`` rule), at least :data:`MIN_CHUNK_TOKENS`, at most ``N``."""
    if min(n_tokens, hidden, vocab) < 1:
        raise ConfigError(f"head shape must be positive, got N={n_tokens} H={hidden} V={vocab}")
    fit = max(n_tokens * hidden // vocab, 1)
    return min(max(1 << (fit.bit_length() - 1), MIN_CHUNK_TOKENS), n_tokens)


def resolve_implementation(impl: str, *, dtype: torch.dtype, device: torch.device) -> str:
    """``"auto"`` -> ``"native"`` where PyTorch's chunked op exists and runs the GEMMs in the
    input's dtype (fp32 anywhere, bf16/fp16 on CUDA), else ``"pure"``."""
    if impl in IMPLEMENTATIONS:
        if impl == "native" and native_linear_cross_entropy() is None:
            raise ConfigError(
                "impl='native' needs torch >= 2.13 (torch.nn.functional.linear_cross_entropy): "
                "use impl='pure' or 'auto'"
            )
        return impl
    if impl != "auto":
        raise ConfigError(f"unknown head implementation {impl!r}: use auto, native, pure or exact")
    if native_linear_cross_entropy() is None:
        return "pure"
    return "native" if dtype == torch.float32 or device.type == "cuda" else "pure"


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_tokens: int,
    bias: torch.Tensor | None = None,
    mode: str = "recompute",
    ignore_index: int = -100,
    num_items: torch.Tensor | int | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, in chunks of tokens.

    Args:
        hidden: ``(N, H)`` hidden states (any float dtype; the GEMMs run in it).
        weight: ``(V, H)`` output embedding; ``bias``: ``(V,)`` or None.
        targets: ``(N,)`` int64 class indices; ``ignore_index`` marks tokens without a loss.
        chunk_tokens: rows per chunk (:func:`chunk_tokens_for`); the last chunk may be shorter.
        mode: ``"recompute"`` or ``"grad-in-forward"`` (module docstring).
        num_items: the denominator: a count (tensor or int) of the tokens the loss averages
            over, as Hugging Face's ``num_items_in_batch``; None: the non-ignored tokens here.
        impl: ``"auto"``, ``"native"``, ``"pure"`` or ``"exact"``
            (:func:`resolve_implementation`).

    Returns:
        The fp32 scalar ``sum of token losses / num_items`` (the mean over non-ignored tokens
        by default: ``F.cross_entropy(..., ignore_index=...)``'s, NaN when none is left).
    """
    check_head_shapes(hidden, weight, targets)
    if mode not in HEAD_MODES:
        raise ConfigError(f"unknown head mode {mode!r}: use {' or '.join(HEAD_MODES)}")
    if chunk_tokens < 1:
        raise ConfigError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    chunk = min(chunk_tokens, max(hidden.shape[0], 1))
    impl = resolve_implementation(impl, dtype=hidden.dtype, device=hidden.device)
    if impl == "exact" and mode != "recompute":
        raise ConfigError("impl='exact' recomputes the logits in backward: use mode='recompute'")
    if impl == "native":
        total = _native_sum(hidden, weight, targets, bias, chunk, mode, ignore_index)
    elif impl == "exact":
        total = _ExactRecomputeSum.apply(hidden, weight, bias, targets, chunk, ignore_index)
    elif mode == "recompute":
        total = _RecomputeSum.apply(hidden, weight, bias, targets, chunk, ignore_index)
    else:
        total = _GradInForwardSum.apply(hidden, weight, bias, targets, chunk, ignore_index)
    return mean_over_items(total, targets, ignore_index, num_items)


def check_head_shapes(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    """Raise a :class:`ConfigError` unless ``hidden`` is ``(N, H)``, ``weight`` ``(V, H)`` and
    ``targets`` int64 ``(N,)``."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ConfigError(
            f"expected hidden (N, H) and weight (V, H), got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1] or targets.dtype != torch.int64:
        raise ConfigError(f"targets must be int64 of shape ({hidden.shape[0]},)")


def mean_over_items(
    total: torch.Tensor, targets: torch.Tensor, ignore_index: int, num_items: Any
) -> torch.Tensor:
    """``total / num_items``; None: over the tokens ``targets`` does not ignore."""
    if num_items is None:
        return total / (targets != ignore_index).sum()
    if isinstance(num_items, torch.Tensor):
        num_items = num_items.to(total.device)
    return total / num_items


def _native_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    chunk: int,
    mode: str,
    ignore_index: int,
) -> torch.Tensor:
    native = native_linear_cross_entropy()
    assert native is not None  # resolve_implementation checked
    function, options_type = native
    # "compact": no (V, H) accumulation scratch beside the weight gradient (PyTorch's docs)
    options = options_type(batch_chunk_size=chunk, chunking_method=None, acc_policy="compact")
    reduction = "none" if mode == "recompute" else "sum"
    losses = function(
        hidden,
        weight,
        targets,
        linear_bias=bias,
        reduction=reduction,
        ignore_index=ignore_index,
        options=options,
    )
    return losses.float().sum() if reduction == "none" else losses.float()


# --------------------------------------------------------------------------- the pure loop
def _valid_targets(targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(safe, valid)``: targets with ignored ones replaced by class 0 (gathers stay in range)
    and a float 0/1 mask, so masking is arithmetic and no ``nonzero`` runs in the loop."""
    ignored = targets == ignore_index
    return targets.masked_fill(ignored, 0), (~ignored).float()


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``(c, V)`` fp32 logits of one chunk: the GEMM in the input's dtype, then upcast."""
    z = h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)
    return z if z.dtype == torch.float32 else z.float()


def _loss_and_softmax(
    z: torch.Tensor, safe: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token losses ``(lse - z[y]) * valid`` and the chunk's log-sum-exp; ``z`` becomes
    ``exp(z - max)`` in place (one ``(c, V)`` buffer)."""
    top = z.amax(dim=1, keepdim=True)  # (c, 1)
    picked = z.gather(1, safe.unsqueeze(1)).squeeze(1)  # (c,)
    lse = z.sub_(top).exp_().sum(dim=1).log_().add_(top.squeeze(1))  # (c,)
    return (lse - picked) * valid, lse


def _softmax_minus_onehot_(
    z: torch.Tensor, lse: torch.Tensor, safe: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``z`` (the chunk's logits) becomes ``(softmax(z) - onehot(y)) * scale`` in place;
    ``scale`` (``(c,)``) is 0 on ignored tokens."""
    z.sub_(lse.unsqueeze(1)).exp_()
    z.scatter_add_(1, safe.unsqueeze(1), -torch.ones_like(scale).unsqueeze(1))
    return z.mul_(scale.unsqueeze(1))


def _accumulate_grads(
    g32: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    dh: torch.Tensor,
    dw: torch.Tensor | None,
    db: torch.Tensor | None,
) -> None:
    """``dh = g W`` into its rows, ``dW += gᵀ h`` and ``db += Σ g``, GEMMs in ``h``'s dtype."""
    g = g32 if g32.dtype == h.dtype else g32.to(h.dtype)
    torch.mm(g, weight, out=dh)
    if dw is not None:
        dw.addmm_(g.T, h)
    if db is not None:
        db.add_(g32.sum(dim=0).to(db.dtype))


class _RecomputeSum(torch.autograd.Function):
    """Sum of token losses; saves the per-token log-sum-exp, recomputes logits in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
        ignore_index: int,
    ) -> torch.Tensor:
        safe, valid = _valid_targets(targets, ignore_index)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            z = _chunk_logits(hidden[rows], weight, bias)  # (c, V)
            losses, lse[rows] = _loss_and_softmax(z, safe[rows], valid[rows])
            total += losses.sum()
            del z
        ctx.save_for_backward(hidden, weight, bias, safe, valid, lse)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, bias, safe, valid, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dh = torch.empty_like(hidden)
        dw = torch.zeros_like(weight) if need_w else None
        db = torch.zeros_like(bias) if need_b and bias is not None else None
        scale = valid * grad.float()  # (N,): the loss's gradient, 0 on ignored tokens
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            z = _chunk_logits(hidden[rows], weight, bias)
            g32 = _softmax_minus_onehot_(z, lse[rows], safe[rows], scale[rows])
            _accumulate_grads(g32, hidden[rows], weight, dh[rows], dw, db)
            del z, g32
        return (dh if need_h else None), dw, db, None, None, None


class _GradInForwardSum(torch.autograd.Function):
    """Sum of token losses with ``dh``, ``dW`` (and ``db``) computed in the forward; the
    backward scales them by the loss's gradient, in place (one backward only)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
        ignore_index: int,
    ) -> torch.Tensor:
        safe, valid = _valid_targets(targets, ignore_index)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dh = torch.empty_like(hidden)
        dw = torch.zeros_like(weight) if need_w else None
        db = torch.zeros_like(bias) if need_b and bias is not None else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            z = _chunk_logits(hidden[rows], weight, bias)
            losses, lse = _loss_and_softmax(z, safe[rows], valid[rows])
            total += losses.sum()
            # z holds exp(z - max) now: the softmax is z / Σz = exp(z - lse)
            z.div_(z.sum(dim=1, keepdim=True))
            z.scatter_add_(1, safe[rows].unsqueeze(1), -torch.ones_like(lse).unsqueeze(1))
            g32 = z.mul_(valid[rows].unsqueeze(1))
            _accumulate_grads(g32, hidden[rows], weight, dh[rows], dw, db)
            del z, g32
        ctx.grads = (dh if need_h else None, dw, db)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if ctx.grads is None:
            raise RuntimeError("the chunked head's gradients were consumed: one backward only")
        dh, dw, db = ctx.grads
        ctx.grads = None  # free them with the graph, not later
        scaled = [t.mul_(grad.to(t.dtype)) if t is not None else None for t in (dh, dw, db)]
        return scaled[0], scaled[1], scaled[2], None, None, None


class _ExactRecomputeSum(torch.autograd.Function):
    """Sum of token losses, the logits recomputed in backward and turned into their gradient by
    the unchunked loss's own kernels (``F.cross_entropy`` is ``log_softmax`` then ``nll_loss``):
    per token, the same arithmetic as the unchunked loss, so the hidden states' gradient is its
    bit for bit wherever the GEMM of a chunk of rows computes each row as the GEMM of all rows."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
        ignore_index: int,
    ) -> torch.Tensor:
        safe, valid = _valid_targets(targets, ignore_index)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logp = torch.log_softmax(_chunk_logits(hidden[rows], weight, bias), dim=1)  # (c, V)
            picked = logp.gather(1, safe[rows].unsqueeze(1)).squeeze(1)  # (c,)
            total -= (picked * valid[rows]).sum()
            del logp
        ctx.save_for_backward(hidden, weight, bias, safe, valid)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, bias, safe, valid = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dh = torch.empty_like(hidden)
        dw = torch.zeros_like(weight) if need_w else None
        db = torch.zeros_like(bias) if need_b and bias is not None else None
        # nll_loss's gradient: minus the loss's gradient at each target (0 where ignored)
        scale = (valid * grad.float()).neg_()  # (N,)
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            logp = torch.log_softmax(_chunk_logits(hidden[rows], weight, bias), dim=1)  # (c, V)
            grad_logp = torch.zeros_like(logp)
            grad_logp.scatter_(1, safe[rows].unsqueeze(1), scale[rows].unsqueeze(1))
            # NOTE: written over logp on the CPU (the kernel reads each element before it
            # writes it, after the row's sum); a separate buffer elsewhere
            out = logp if logp.device.type == "cpu" else torch.empty_like(logp)
            g32 = torch.ops.aten._log_softmax_backward_data.out(
                grad_logp, logp, 1, torch.float32, out=out
            )
            del grad_logp
            _accumulate_grads(g32, hidden[rows], weight, dh[rows], dw, db)
            del logp, g32, out
        return (dh if need_h else None), dw, db, None, None, None
