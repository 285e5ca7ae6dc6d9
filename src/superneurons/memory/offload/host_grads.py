"""Gradients on the host between backward and the step: their sums over micro-batches, their
norms, and clipping by the global norm.

When the loop clips or accumulates (:class:`~superneurons.memory.plan.TrainingStep`), the host
optimizer cannot step a bucket as soon as it lands: the step needs the global norm of all
gradients, or the last micro-batch. So each bucket's gradients stay in host buffers
(:class:`HostGradients`) until the loop's ``optimizer.step()``; as ZeRO-Offload does (Ren et
al., USENIX ATC'21), micro-batches are summed there, on the host, and the step runs once per
accumulation boundary.

Norms and clipping are ``torch.nn.utils.clip_grad_norm_``'s arithmetic, op for op, on the same
values: each gradient's norm by ``torch._foreach_norm`` (computed on the device as its final
sum lands, or here for a sum completed on the host), the total as the norm of those norms
stacked in the order of the parameters the loop passes, grouped by dtype as
``clip_grad_norm_`` groups them, the coefficient ``max_norm / (total + 1e-6)`` clamped to 1
and multiplied into every gradient by ``torch._foreach_mul_``. On one device the result is
bitwise the same; a non-finite total is not refused (``error_if_nonfinite=False``, what
``transformers.Trainer`` calls): every gradient becomes NaN (or 0 and NaN for an infinite
total) and the step runs on them, as it would on the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["HostGradients", "clip_coefficient", "clip_grad_norm_", "total_norm"]


def total_norm(norms: Sequence[torch.Tensor], dtypes: Sequence[Any], norm_type: float) -> Any:
    """The global norm of gradients whose per-tensor ``norms`` (in the order of the
    parameters) were computed from gradients of ``dtypes``: ``clip_grad_norm_``'s order, the
    norms grouped by dtype in order of first appearance, then the norm of them stacked."""
    if not norms:
        return torch.tensor(0.0)
    order: dict[Any, list[torch.Tensor]] = {}
    for norm, dtype in zip(norms, dtypes, strict=True):
        order.setdefault(dtype, []).append(norm)
    grouped = [n for group in order.values() for n in group]
    device = grouped[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in grouped]), norm_type)


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_``'s factor: ``min(max_norm / (total + 1e-6), 1)`` (NaN stays NaN)."""
    return torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)`` for gradients on one
    device, op for op (its foreach path, which it takes for CPU and CUDA tensors): the same
    arithmetic the host gradients get, for optimizer-in-backward and ``superneurons train``."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    with torch.no_grad():
        groups = _by_dtype(grads)
        norms = [n for group in groups.values() for n in torch._foreach_norm(group, norm_type)]
        dtypes = [dtype for dtype, group in groups.items() for _ in group]
        total = total_norm(norms, dtypes, norm_type)
        coefficient = clip_coefficient(total, max_norm)
        for group in groups.values():
            torch._foreach_mul_(group, coefficient.to(group[0].device))
    return total


def _by_dtype(tensors: Iterable[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    groups: dict[Any, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return groups


class HostGradients:
    """Host buffers of gradients waiting for the step, by parameter fqn, in the gradients'
    dtype, with the norm of each final sum.

    ``land(..., final=False)`` adds a micro-batch's gradients into the buffers (autograd's
    ``grad += new``, elementwise, so the sum is bitwise the one ``.grad`` would hold);
    ``land(..., final=True)`` stores sums completed on the device (the last micro-batch added
    the buffers there before its all-reduce), whose norms :meth:`record_norms` keeps.
    """

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.norms: dict[str, torch.Tensor] = {}  # fqn -> norm of its final gradient
        self.dtypes: dict[str, Any] = {}  # fqn -> dtype of the gradient of that norm
        self.norm_type = 2.0  # the p of ``norms``

    def __bool__(self) -> bool:
        return bool(self.buffers)

    def land(self, grads: dict[str, torch.Tensor], *, final: bool) -> None:
        """A micro-batch's gradients added into the buffers, or (``final``) final sums stored
        as they are."""
        for fqn, grad in grads.items():
            if final or fqn not in self.buffers:
                self.buffers[fqn] = grad
            else:
                self.buffers[fqn].add_(grad)
            self.norms.pop(fqn, None)

    def record_norms(self, norms: dict[str, torch.Tensor], dtype: Any, norm_type: float) -> None:
        """The norms of final gradients (of ``dtype``), computed where they were complete."""
        if norm_type != self.norm_type:
            self.norms.clear()
            self.norm_type = norm_type
        self.norms.update(norms)
        self.dtypes.update(dict.fromkeys(norms, dtype))

    def pending(self, fqns: Iterable[str]) -> dict[str, torch.Tensor]:
        """The buffers of ``fqns`` that hold a sum (those of earlier micro-batches)."""
        return {f: self.buffers[f] for f in fqns if f in self.buffers}

    def norm(self, order: Sequence[str], norm_type: float) -> torch.Tensor:
        """The global norm of the gradients of ``order`` (fqns in the loop's parameter order)
        that are buffered or whose norms were recorded; a buffered sum's norm not recorded as
        it landed is computed here."""
        if norm_type != self.norm_type:
            self.norms.clear()
            self.norm_type = norm_type
        names = [f for f in order if f in self.buffers or f in self.norms]
        missing = [f for f in names if f not in self.norms]
        groups: dict[Any, list[str]] = {}
        for fqn in missing:
            groups.setdefault(self.buffers[fqn].dtype, []).append(fqn)
        for dtype, group in groups.items():
            computed = torch._foreach_norm([self.buffers[f] for f in group], norm_type)
            self.record_norms(dict(zip(group, computed, strict=True)), dtype, norm_type)
        return total_norm(
            [self.norms[f] for f in names], [self.dtypes[f] for f in names], norm_type
        )

    def scale_(self, coefficient: torch.Tensor) -> None:
        """Multiply every buffered gradient by ``coefficient`` in place (per dtype)."""
        for group in _by_dtype(self.buffers.values()).values():
            torch._foreach_mul_(group, coefficient.to(group[0].device))
        self.norms.clear()  # of the sums before scaling

    def take(self, fqns: Iterable[str]) -> dict[str, torch.Tensor]:
        """Remove and return the buffers of ``fqns`` that hold gradients."""
        return {f: self.buffers.pop(f) for f in list(fqns) if f in self.buffers}

    def clear(self) -> None:
        """Drop the buffers and the norms (a new step begins)."""
        self.buffers.clear()
        self.norms.clear()

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())
