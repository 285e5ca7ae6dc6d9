"""Kept CPU work buffers for the sparse codecs' large temporaries.

On the CPU a fresh multi-MiB temporary is served by ``mmap`` or by a heap that glibc has just
trimmed, so every 4 KiB page faults on first touch (the kernel zeroes it). Measured on the
``fft`` and ``adaptive`` encoders at 4 MiB (one thread, a 2-core AMD EPYC): 800-2,500 minor faults and
2-7 ms of system time per call, which also made the speed spread between processes up to 2x.
A codec takes its scratch from :func:`workspace` instead: on the CPU a buffer kept per thread
(so concurrent hooks never share one) for ``(tag, shape, dtype)``, on every other device a
fresh ``torch.empty``, because the CUDA caching allocator already recycles blocks and a kept
buffer would need stream bookkeeping to be safe (so CUDA semantics are unchanged).

Rules for callers: the contents are undefined on return; a workspace tensor is never handed
back to the caller of a codec (payloads and decodes are fresh tensors); one tag per use site,
so two live buffers never share one. Bounds: at most ``_SHAPES_PER_TAG`` shapes per tag (least
recently used dropped) and nothing above ``_KEEP_MAX_BYTES`` is kept (such buffers are fresh).
Memory: up to a few buffers of 4-8 bytes per element of each bucket size a thread encodes
(e.g. ~130 MB for the adaptive codec on 25 MiB buckets); :func:`clear_workspace` drops them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

__all__ = ["clear_workspace", "workspace"]

_SHAPES_PER_TAG = 4  # DDP buckets come in a few sizes (full buckets and the last one)
_KEEP_MAX_BYTES = 64 << 20  # above this a page fault per 4 KiB is small next to the work

_Key = tuple[tuple[int, ...], torch.dtype]
_local = threading.local()


def _kept() -> dict[str, OrderedDict[_Key, torch.Tensor]]:
    kept = getattr(_local, "buffers", None)
    if kept is None:
        kept = _local.buffers = {}
    return kept


def workspace(
    tag: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """An uninitialised ``shape`` ``dtype`` buffer on ``device``: kept per thread and ``tag`` on
    the CPU (see the module doc for the rules), a fresh ``torch.empty`` elsewhere."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if device.type != "cpu" or nbytes > _KEEP_MAX_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    by_shape = _kept().setdefault(tag, OrderedDict())
    key = (tuple(shape), dtype)
    buffer = by_shape.get(key)
    if buffer is None:
        buffer = by_shape[key] = torch.empty(shape, dtype=dtype)
        while len(by_shape) > _SHAPES_PER_TAG:
            by_shape.popitem(last=False)
    else:
        by_shape.move_to_end(key)
    return buffer


def clear_workspace() -> None:
    """Drop the calling thread's kept buffers (their memory goes back to the allocator)."""
    _local.buffers = {}
