"""Unified Tensor Pool: offload saved activations to host memory, prefetch them for backward.

SuperNeurons (Wang et al., PPoPP'18, arXiv 1801.04380, section 3.2) treats device memory as a
cache over pinned host memory: a tensor is copied out only when memory is actually short (LRU
eviction, unlike vDNN which always copies), the host side is one preallocated pinned pool (no
malloc per tensor), and the tensors of the previous checkpoint are prefetched during backward so
the copy hides behind compute.

In eager PyTorch the pool sits behind :func:`torch.autograd.graph.saved_tensors_hooks`, active
only while an ``offload`` unit's forward runs (the runtime enters :meth:`TensorPool.offloading`):

* ``pack`` keeps the saved tensor in a device-side LRU cache of ``cache_bytes``; what does not
  fit is evicted: copied device→host into the slab on a side stream (ordered by a CUDA event,
  never ``torch.cuda.synchronize()``) and its device reference dropped. Parameters, buffers,
  tensors below ``min_offload_bytes`` and non-dense layouts are returned unchanged (kept).
* when backward enters an offload unit (an autograd-node pre-hook on the unit's outputs), the
  pool prefetches host→device, on another side stream, that unit's tensors and those of the
  offload unit that ran just before it in forward, i.e. one unit ahead of the backward.
* ``unpack`` returns the cached or prefetched tensor (waiting on its event) or fetches it.
* a slot is released when autograd drops the packed handle (after the node's backward), so
  the pool's accounting returns to zero after every step.

On a CPU-only build the same code runs: the "device" is host memory, copies go into the slab
synchronously and streams/events are ``None``. A dispatch-level live-storage count then sees
exactly what a GPU would hold, because the slab is allocated before the step and the evicted
activation's storage is really freed.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from superneurons.bytesize import format_bytes
from superneurons.errors import ConfigError

__all__ = ["PoolConfig", "PoolStats", "TensorPool"]

logger = logging.getLogger("superneurons.memory")

_ALIGN_BYTES = 512  # slot alignment in the slab: keeps every dtype view aligned for DMA


@dataclass(frozen=True)
class PoolConfig:
    """Hyper-parameters of the tensor pool.

    Attributes:
        min_offload_bytes: saved tensors smaller than this stay on the device (a copy of a few
            KiB costs more launch latency than it saves memory).
        host_bytes: initial slab capacity; it doubles (with a log message) when too small.
        cache_bytes: device bytes that packed tensors may keep before LRU eviction to the host
            (0: evict at once, what the planner predicts for ``offload``).
        prefetch: prefetch one offload unit ahead of backward (else fetch on demand).
    """

    min_offload_bytes: int = 16 * 1024
    host_bytes: int = 0
    cache_bytes: int = 0
    prefetch: bool = True

    def __post_init__(self) -> None:
        for name in ("min_offload_bytes", "host_bytes", "cache_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"PoolConfig.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool's accounting (bytes are storage bytes)."""

    host_bytes: int  # bytes now held in the host slab
    device_bytes: int  # bytes of packed tensors now held on the device (cache + prefetched)
    peak_host_bytes: int
    slab_capacity_bytes: int
    live_slots: int
    d2h_bytes: int
    h2d_bytes: int
    d2h_count: int
    h2d_count: int
    cache_hits: int  # unpacked while still cached on the device (never copied)
    prefetch_hits: int  # unpacked after a prefetch had brought it back
    demand_fetches: int  # unpacked with a synchronous fetch (prefetch missed)
    kept_small: int  # saved tensors kept because of min_offload_bytes / layout / parameters
    still_resident: int  # fetches served by the original tensor, still alive elsewhere


class _Slot:
    """One packed tensor: its metadata, device copy (cached/prefetched) and host copy."""

    __slots__ = (
        "size",
        "stride",
        "dtype",
        "device",
        "nbytes",
        "version",
        "device_tensor",
        "original",
        "host",
        "event",
    )

    def __init__(self, tensor: torch.Tensor) -> None:
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.dtype = tensor.dtype
        self.device = tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        self.version = tensor._version
        self.device_tensor: torch.Tensor | None = tensor
        # After eviction: the original, if something else (the model input, a later unit's
        # activation) keeps it alive, is reused instead of a second copy.
        self.original: weakref.ref[torch.Tensor] = weakref.ref(tensor)
        self.host: torch.Tensor | None = None  # contiguous view into the slab
        self.event: Any = None  # CUDA event of the last copy touching ``device_tensor``/``host``


class _Handle:
    """What ``pack`` returns; autograd owns it and drops it after the node's backward."""

    __slots__ = ("slot", "group", "uses", "pending", "__weakref__")

    def __init__(self, slot: _Slot, group: int) -> None:
        self.slot = slot
        self.group = group
        self.uses = 1  # how many saved variables share this handle (deduplicated packs)
        self.pending = 1  # unpacks still expected in the current backward


class _HostSlab:
    """A bump allocator over one preallocated (pinned on CUDA) byte buffer, reset when empty."""

    def __init__(self, capacity_bytes: int, *, pinned: bool) -> None:
        self.pinned = pinned
        self.buffer = self._allocate(capacity_bytes)
        self.offset = 0
        self.live_bytes = 0
        self.live_slots = 0
        self.peak_aligned_bytes = 0  # most aligned bytes live at once, over all buffers
        self._aligned_live = 0

    def _allocate(self, capacity_bytes: int) -> torch.Tensor:
        return torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=self.pinned)

    @property
    def capacity_bytes(self) -> int:
        return int(self.buffer.numel())

    def take(self, nbytes: int) -> torch.Tensor:
        need = -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
        if self.live_slots == 0:
            self.offset = 0
        if self.offset + need > self.capacity_bytes:
            grown = max(2 * self.capacity_bytes, self.offset + need, 1 << 20)
            logger.info(
                "host pool slab too small (%s): growing to %s",
                format_bytes(self.capacity_bytes),
                format_bytes(grown),
            )
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
        self._aligned_live -= -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
        if self.live_slots == 0 and self.capacity_bytes < self.peak_aligned_bytes:
            # The step that just ended spread over several buffers after growing: take one
            # buffer that holds it all now, between steps, so the next step allocates nothing.
            self.buffer = self._allocate(self.peak_aligned_bytes)
            self.offset = 0


class TensorPool:
    """Host pool + device cache for the saved tensors of ``offload`` units (see module doc)."""

    def __init__(
        self,
        config: PoolConfig,
        *,
        device: torch.device,
        excluded: Callable[[], Iterable[torch.Tensor]] = tuple,
    ) -> None:
        self.config = config
        self.device = device
        self._excluded = excluded  # parameters and buffers: never offloaded
        self._cuda = device.type == "cuda"
        self._d2h_stream = torch.cuda.Stream(device) if self._cuda else None
        self._h2d_stream = torch.cuda.Stream(device) if self._cuda else None
        self._slab = _HostSlab(config.host_bytes, pinned=self._cuda)
        self._cache: collections.OrderedDict[int, _Slot] = collections.OrderedDict()
        self._groups: dict[int, list[weakref.ref[_Handle]]] = {}
        self._next_group = 0
        self._active_group: int | None = None
        self._excluded_ptrs: set[int] = set()
        self._dedupe: dict[int, tuple[weakref.ref[torch.Tensor], int, _Handle]] = {}
        self._counters = dict.fromkeys(
            (
                "d2h_bytes",
                "h2d_bytes",
                "d2h_count",
                "h2d_count",
                "cache_hits",
                "prefetch_hits",
                "demand_fetches",
                "kept_small",
                "still_resident",
            ),
            0,
        )
        self._device_bytes = 0
        self._peak_host_bytes = 0

    # ----------------------------------------------------------------- forward side
    @contextlib.contextmanager
    def offloading(self) -> Iterator[int]:
        """Pack saved tensors into the pool while the block runs; yields the group id."""
        if self._active_group is not None:
            raise ConfigError("offload units must not be nested: keep only the outer unit")
        group = self._next_group
        self._next_group += 1
        self._groups[group] = []
        self._active_group = group
        self._excluded_ptrs = {t.untyped_storage().data_ptr() for t in self._excluded()}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield group
        finally:
            self._active_group = None
            self._dedupe.clear()
            if not self._groups[group]:
                del self._groups[group]

    def _offloadable(self, tensor: torch.Tensor) -> bool:
        return (
            type(tensor) is torch.Tensor
            and tensor.layout == torch.strided
            and tensor.device.type == self.device.type  # not meta/fake, not a stray CPU tensor
            and tensor.numel() * tensor.element_size() >= max(self.config.min_offload_bytes, 1)
            and _non_overlapping_and_dense(tensor)
            and tensor.untyped_storage().data_ptr() not in self._excluded_ptrs
        )

    def _pack(self, tensor: torch.Tensor) -> Any:
        if not self._offloadable(tensor):
            self._counters["kept_small"] += 1
            return tensor
        # The same activation is often saved by two nodes (e.g. an output read by the next
        # two layers): share one slot while the tensor object and its version are unchanged.
        seen = self._dedupe.get(id(tensor))
        if seen is not None and seen[0]() is tensor and seen[1] == tensor._version:
            seen[2].uses += 1
            seen[2].pending += 1
            return seen[2]
        assert self._active_group is not None
        slot = _Slot(tensor)
        handle = _Handle(slot, self._active_group)
        self._dedupe[id(tensor)] = (weakref.ref(tensor), tensor._version, handle)
        self._groups[self._active_group].append(weakref.ref(handle))
        weakref.finalize(handle, self._release, slot)
        self._device_bytes += slot.nbytes
        self._cache[id(slot)] = slot
        self._evict_to(self.config.cache_bytes)
        return handle

    def _evict_to(self, limit_bytes: int) -> None:
        """Evict least-recently-used cached tensors until the cache holds ``limit_bytes``."""
        while self._cache and self._cached_bytes() > limit_bytes:
            _, slot = self._cache.popitem(last=False)
            self._to_host(slot)

    def _cached_bytes(self) -> int:
        return sum(s.nbytes for s in self._cache.values())

    def _to_host(self, slot: _Slot) -> None:
        tensor = slot.device_tensor
        assert tensor is not None
        if slot.host is None:
            raw = self._slab.take(slot.nbytes)
            slot.host = raw.view(slot.dtype).view(-1)
            self._peak_host_bytes = max(self._peak_host_bytes, self._slab.live_bytes)
            if self._d2h_stream is not None:
                self._d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._d2h_stream):
                    _copy_dense(slot.host, tensor, non_blocking=True)
                    tensor.record_stream(self._d2h_stream)
                    slot.event = torch.cuda.Event()
                    slot.event.record(self._d2h_stream)
            else:
                _copy_dense(slot.host, tensor, non_blocking=False)
            self._counters["d2h_bytes"] += slot.nbytes
            self._counters["d2h_count"] += 1
        slot.device_tensor = None
        self._device_bytes -= slot.nbytes

    # ---------------------------------------------------------------- backward side
    def backward_entered(self, group: int) -> None:
        """Backward reached the outputs of offload group ``group``: prefetch it and the one
        before it (forward order), so the next unit's copy overlaps this unit's backward."""
        if not self.config.prefetch:
            return
        earlier = [g for g in self._groups if g < group]
        for g in (group, *(earlier[-1:])):
            for ref in self._groups.get(g, ()):
                handle = ref()
                if handle is not None and handle.slot.device_tensor is None:
                    self._to_device(handle.slot)

    def _to_device(self, slot: _Slot) -> None:
        assert slot.host is not None, "a slot without device tensor has a host copy"
        original = slot.original()
        if original is not None and original._version == slot.version:
            self._counters["still_resident"] += 1
            slot.device_tensor = original
            self._device_bytes += slot.nbytes
            return
        if self._h2d_stream is not None:
            if slot.event is not None:
                self._h2d_stream.wait_event(slot.event)
            with torch.cuda.stream(self._h2d_stream):
                tensor = torch.empty_strided(
                    slot.size, slot.stride, dtype=slot.dtype, device=self.device
                )
                _copy_dense(tensor, slot.host, non_blocking=True)
                slot.event = torch.cuda.Event()
                slot.event.record(self._h2d_stream)
        else:
            tensor = torch.empty_strided(
                slot.size, slot.stride, dtype=slot.dtype, device=slot.device
            )
            _copy_dense(tensor, slot.host, non_blocking=False)
        slot.device_tensor = tensor
        self._device_bytes += slot.nbytes
        self._counters["h2d_bytes"] += slot.nbytes
        self._counters["h2d_count"] += 1

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed  # type: ignore[no-any-return]
        slot = packed.slot
        if slot.device_tensor is None:
            self._counters["demand_fetches"] += 1
            self._to_device(slot)
        elif slot.host is None:
            self._counters["cache_hits"] += 1
            self._cache.move_to_end(id(slot))  # most recently used
        else:
            self._counters["prefetch_hits"] += 1
        tensor = slot.device_tensor
        assert tensor is not None
        if self._cuda and slot.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(slot.event)
            tensor.record_stream(current)
        packed.pending -= 1
        if slot.host is not None and packed.pending <= 0:
            # NOTE: once its last user unpacked it, a fetched copy belongs to autograd; the pool
            # keeps the host copy (retain_graph may unpack again) and forgets the device one.
            packed.pending = packed.uses
            slot.device_tensor = None
            self._device_bytes -= slot.nbytes
        return tensor

    def _release(self, slot: _Slot) -> None:
        """Autograd dropped the handle: free the slot's host and device bytes."""
        if self._cuda and slot.event is not None:
            # A prefetch nobody unpacked may still be reading the host slot: order the slot's
            # reuse (by a later device->host copy, which waits on this stream) after it.
            torch.cuda.current_stream(self.device).wait_event(slot.event)
        if slot.device_tensor is not None:
            self._device_bytes -= slot.nbytes
            slot.device_tensor = None
        self._cache.pop(id(slot), None)
        if slot.host is not None:
            self._slab.give_back(slot.nbytes)
            slot.host = None
        for group in [g for g, refs in self._groups.items() if g != self._active_group]:
            refs = [r for r in self._groups[group] if r() is not None]
            if refs:
                self._groups[group] = refs
            else:
                del self._groups[group]

    # ------------------------------------------------------------------- accounting
    def stats(self) -> PoolStats:
        return PoolStats(
            host_bytes=self._slab.live_bytes,
            device_bytes=self._device_bytes,
            peak_host_bytes=self._peak_host_bytes,
            slab_capacity_bytes=self._slab.capacity_bytes,
            live_slots=self._slab.live_slots + len(self._cache),
            **self._counters,
        )

    def host_buffers(self) -> list[torch.Tensor]:
        """The host slab the pool owns: register it with a live-storage tracker and subtract
        it, so the count is device memory only (the pool is host memory by definition)."""
        return [self._slab.buffer]

    def state_dict(self) -> dict[str, Any]:
        """Counters and the peak; live slots are per step and are not saved."""
        return {"counters": dict(self._counters), "peak_host_bytes": self._peak_host_bytes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._counters.update({k: int(v) for k, v in state["counters"].items()})
        self._peak_host_bytes = int(state["peak_host_bytes"])

    def reset_peak(self) -> None:
        self._peak_host_bytes = self._slab.live_bytes

    def as_dict(self) -> dict[str, int]:
        return asdict(self.stats())


def _copy_dense(dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool) -> None:
    """Copy between a dense strided tensor and a flat contiguous host buffer, byte for byte.

    The flat side stores the elements in the dense tensor's memory order, so the copy is one
    contiguous memcpy whatever the strides (channels-last, transposed views).
    """
    if dst.dim() == 1 and dst.is_contiguous() and src.dim() != 1:
        dst.copy_(_memory_order(src), non_blocking=non_blocking)
    elif src.dim() == 1 and src.is_contiguous() and dst.dim() != 1:
        _memory_order(dst).copy_(src, non_blocking=non_blocking)
    else:
        dst.view(-1).copy_(src.reshape(-1), non_blocking=non_blocking)


def _non_overlapping_and_dense(tensor: torch.Tensor) -> bool:
    """True if the elements fill ``numel`` consecutive storage slots (any dimension order)."""
    expected = 1
    for size, stride in sorted(
        zip(tensor.size(), tensor.stride(), strict=True), key=lambda d: d[1]
    ):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _memory_order(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a non-overlapping dense tensor in memory order (no copy)."""
    return tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset())
