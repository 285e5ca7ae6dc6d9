"""The host side of the Unified Tensor Pool: one preallocated byte buffer and a bump allocator,
and the memory-order layout of what it stores (one memcpy per slot whatever the strides).

SuperNeurons (Wang et al., PPoPP'18 §3.2) preallocates the pool so no step pays for malloc/free;
on CUDA the buffer is pinned, so copies run asynchronously on a side stream.
"""

from __future__ import annotations

import logging

import torch

from superneurons.bytesize import format_bytes
from superneurons.compat import fake_cache_disabled

__all__ = [
    "HostSlab",
    "alias_storage",
    "memory_order",
    "non_overlapping_and_dense",
    "whole_storage",
]

logger = logging.getLogger("superneurons.memory")

_ALIGN_BYTES = 512  # slot alignment in the slab: keeps every dtype view aligned for DMA


class HostSlab:
    """A bump allocator over one preallocated (pinned on CUDA) byte buffer, reset when empty."""

    def __init__(self, capacity_bytes: int, *, pinned: bool, device: str = "cpu") -> None:
        self.pinned = pinned
        self.device = device  # "meta" under simulation: no bytes behind the buffer
        self.buffer = self._allocate(capacity_bytes)
        self.offset = 0
        self.live_bytes = 0
        self.live_slots = 0
        self.peak_aligned_bytes = 0  # most aligned bytes live at once, over all buffers
        self._aligned_live = 0

    def _allocate(self, capacity_bytes: int) -> torch.Tensor:
        if self.device == "meta":
            return torch.empty(capacity_bytes, dtype=torch.uint8, device="meta")
        return torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=self.pinned)

    @property
    def capacity_bytes(self) -> int:
        return int(self.buffer.numel())

    def take(self, nbytes: int) -> torch.Tensor:
        need = _aligned(nbytes)
        if self.live_slots == 0:
            self.offset = 0
        if self.offset + need > self.capacity_bytes:
            grown = max(2 * self.capacity_bytes, self.offset + need, 1 << 20)
            sizes = format_bytes(self.capacity_bytes), format_bytes(grown)
            logger.info("host pool slab too small (%s): growing to %s", *sizes)
            # NOTE: slots already handed out keep the old buffer alive through their views;
            # it is freed once they are released.
            self.buffer = self._allocate(grown)
            self.offset = 0
        view = self.buffer[self.offset : self.offset + nbytes]
        self.offset += need
        self.live_bytes += nbytes
        self.live_slots += 1
        self._aligned_live += need
        self.peak_aligned_bytes = max(self.peak_aligned_bytes, self._aligned_live)
        return view

    def give_back(self, nbytes: int) -> None:
        self.live_bytes -= nbytes
        self.live_slots -= 1
        self._aligned_live -= _aligned(nbytes)
        if self.live_slots == 0 and self.capacity_bytes < self.peak_aligned_bytes:
            # The step that just ended spread over several buffers after growing: take one
            # buffer that holds it all now, between steps, so the next step allocates nothing.
            self.buffer = self._allocate(self.peak_aligned_bytes)
            self.offset = 0


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES  # round up


def whole_storage(tensor: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of all of ``tensor``'s storage in its dtype, or None when ``tensor`` already
    fills its storage densely (or the storage is not a whole number of its elements)."""
    storage_bytes = tensor.untyped_storage().nbytes()
    itemsize = tensor.element_size()
    fills = tensor.numel() * itemsize == storage_bytes and non_overlapping_and_dense(tensor)
    if fills or storage_bytes % itemsize or storage_bytes == 0:
        return None
    return tensor.as_strided((storage_bytes // itemsize,), (1,), 0)


def non_overlapping_and_dense(tensor: torch.Tensor) -> bool:
    """True if the elements fill ``numel`` consecutive storage slots (any dimension order)."""
    expected = 1
    dims = sorted(zip(tensor.size(), tensor.stride(), strict=True), key=lambda d: d[1])
    for size, stride in dims:
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def memory_order(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a non-overlapping dense tensor in memory order (no copy): the slab stores
    elements in that order, so each copy is one memcpy whatever the strides."""
    return tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset())


def alias_storage(
    storage: torch.UntypedStorage,
    offset: int | torch.SymInt,
    size: torch.Size,
    stride: tuple[int, ...],
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A tensor over ``storage`` (still alive elsewhere) with the given geometry: no copy."""
    tensor = torch.empty(0, dtype=dtype, device=device)
    mode = getattr(tensor, "fake_mode", None)  # simulating (memory.sizing.simulate)
    if mode is None:
        return tensor.set_(storage, offset, size, stride)
    # NOTE: the fake dispatch cache would keep ``storage`` (an argument, so part of the key)
    # for the rest of the process: a simulated step held it past its last use, one activation
    # above the same step on real tensors (measured)
    with fake_cache_disabled(mode):
        return tensor.set_(storage, offset, size, stride)
