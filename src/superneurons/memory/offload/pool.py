"""Unified Tensor Pool: offload saved activations to host memory, prefetch them for backward.

SuperNeurons (Wang et al., PPoPP'18, arXiv 1801.04380, §3.2): device memory is a cache over one
preallocated pinned host pool; a tensor is copied out only when memory is short (LRU, unlike
vDNN which always copies) and prefetched during backward so the copy hides behind compute.

In eager PyTorch the pool sits behind :func:`torch.autograd.graph.saved_tensors_hooks`, active
only while an ``offload`` unit's forward runs (the runtime enters :meth:`TensorPool.offloading`):

* ``pack`` keeps the tensor in a device LRU cache of ``cache_bytes``; what does not fit is copied
  device→host into the slab on a side stream (CUDA events, never ``torch.cuda.synchronize()``)
  and its device reference dropped. Parameters, buffers, tensors below ``min_offload_bytes``
  and non-dense layouts are kept. A slot holds a whole storage, so views of one storage saved
  in one step (``x``, ``x.view(-1, C)``, ``x[1:]``, in any order, by one unit or by two) share
  it: one copy each way, as the planner counts saved bytes per storage.
* when backward enters an offload unit (autograd-node pre-hook on its outputs) the pool
  prefetches, on another side stream, its tensors and the previous offload unit's: one ahead.
* ``unpack`` returns the cached or prefetched tensor (waiting on its event) or fetches it; a
  slot is freed when autograd drops its handle, so the accounting returns to zero each step.

On a CPU-only build the same code runs (copies into the slab are synchronous, no streams); a
live-storage count minus :meth:`TensorPool.host_buffers` then sees what a GPU would hold.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from superneurons.errors import ConfigError
from superneurons.memory.offload.slab import (
    HostSlab,
    alias_storage,
    memory_order,
    non_overlapping_and_dense,
    whole_storage,
)
from superneurons.memory.planner.cost import MIN_OFFLOAD_BYTES

__all__ = ["MIN_OFFLOAD_BYTES", "PoolConfig", "PoolStats", "TensorPool"]

logger = logging.getLogger("superneurons.memory")


_COUNTERS = ["d2h_bytes", "h2d_bytes", "d2h_count", "h2d_count", "cache_hits", "prefetch_hits"]
_COUNTERS += ["demand_fetches", "kept_small", "still_resident"]


@dataclass(frozen=True)
class PoolConfig:
    """Hyper-parameters of the tensor pool.

    Attributes:
        min_offload_bytes: smaller saved tensors stay (copy latency outweighs the bytes).
        host_bytes: initial slab capacity; it doubles (with a log message) when too small.
        cache_bytes: device bytes packed tensors may keep before LRU eviction (0: evict at once,
            as the planner predicts for ``offload``).
        prefetch: prefetch one offload unit ahead of backward (else fetch on demand).
        host_device: where host copies live: ``"cpu"`` (pinned when the device is CUDA), or
            ``"meta"`` to simulate the pool on fake tensors (copies keep only metadata, so a
            live-storage count sees exactly the device bytes; ``memory.sizing.simulate``).
    """

    min_offload_bytes: int = MIN_OFFLOAD_BYTES
    host_bytes: int = 0
    cache_bytes: int = 0
    prefetch: bool = True
    host_device: str = "cpu"

    def __post_init__(self) -> None:
        if self.host_device not in ("cpu", "meta"):
            raise ConfigError(
                f"PoolConfig.host_device must be 'cpu' or 'meta', got {self.host_device!r}"
            )
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

    def __init__(self, tensor: torch.Tensor) -> None:
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.dtype = tensor.dtype
        self.device = tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        self.version = tensor._version
        # dense: strides kept (memcpy in memory order); else compacted
        self.dense = non_overlapping_and_dense(tensor)
        self.device_tensor: torch.Tensor | None = tensor
        # reused after eviction if still alive elsewhere (an input, a keep unit's saved output)
        self.original, self.offset = weakref.ref(tensor), tensor.storage_offset()
        self.storage = weakref.ref(tensor.untyped_storage())
        self.host: torch.Tensor | None = None  # contiguous view into the slab
        self.event: Any = None  # CUDA event of the last copy touching ``device_tensor``/``host``
        self.uses = 0  # saved variables sharing the slot (the tensor and views inside it)
        self.pending = 0  # unpacks still expected in the current backward
        self.handles = 0  # live handles (autograd drops each after its node's backward)
        self.key = (_storage_key(tensor), tensor.dtype)  # slots are shared per storage

    def covers(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor`` (same storage) lies in the memory this dense slot copies."""
        extent = sum((n - 1) * st for n, st in zip(tensor.size(), tensor.stride(), strict=True))
        first = tensor.storage_offset()
        numel = self.nbytes // tensor.element_size()
        return self.dense and self.offset <= first and first + extent < self.offset + numel


class _Handle:
    """What ``pack`` returns; autograd owns it and drops it after the node's backward.

    ``view`` is None for the tensor the slot was made from, else (size, stride, offset from the
    slot's first element) of another view inside the slot's memory (``x`` and ``x.view(-1, C)``,
    saved by two nodes: one copy each way, as the planner counts one storage)."""

    __slots__ = ("slot", "view", "__weakref__")

    def __init__(self, slot: _Slot, view: tuple[Any, Any, Any] | None = None) -> None:
        self.slot = slot
        self.view = view


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
        self.copy_streams = (
            self._d2h_stream,
            self._h2d_stream,
        )  # shared: memory.offload.optim_host
        self._slab = HostSlab(config.host_bytes, pinned=self._cuda, device=config.host_device)
        self._cache: collections.OrderedDict[int, _Slot] = collections.OrderedDict()
        self._groups: dict[int, list[weakref.ref[_Handle]]] = {}
        self._next_group = 0
        self._active_group: int | None = None
        self._excluded_ptrs: set[int] = set()
        self._dedupe: dict[tuple[int, torch.dtype], list[tuple[Any, _Slot]]] = {}
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._device_bytes = 0
        self._peak_host_bytes = 0
        # streamed weights (memory.offload.weights): saved views of their device copies are
        # packed as references, asked before anything else
        self.weights: Any = None

    @contextlib.contextmanager
    def offloading(self) -> Iterator[int]:
        """Pack saved tensors into the pool while the block runs; yields the group id."""
        if self._active_group is not None:
            raise ConfigError("offload units must not be nested: keep only the outer unit")
        group = self._next_group
        self._next_group += 1
        self._groups[group] = []
        self._active_group = group
        self._excluded_ptrs = {_storage_key(t) for t in self._excluded()}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield group
        finally:
            self._active_group = None
            if not self._groups.get(group):
                self._groups.pop(group, None)

    def _offloadable(self, tensor: torch.Tensor) -> bool:
        return (
            (type(tensor) is torch.Tensor or self.config.host_device == "meta")
            and tensor.layout == torch.strided
            and tensor.device.type == self.device.type  # not meta/fake, not a stray CPU tensor
            and tensor.untyped_storage().nbytes() >= max(self.config.min_offload_bytes, 1)
            and all(
                st != 0 for sz, st in zip(tensor.size(), tensor.stride(), strict=True) if sz > 1
            )
            and _storage_key(tensor) not in self._excluded_ptrs
        )

    def _pack(self, tensor: torch.Tensor) -> Any:
        ref = self.weights.pack(tensor) if self.weights is not None else None
        if ref is not None:
            return ref
        if not self._offloadable(tensor):
            self._counters["kept_small"] += 1
            return tensor
        # views of one storage saved in this step share the slot that holds them (same storage,
        # same version), also across units (a block's output saved by it and by the next
        # block): one copy out and one back, live from the first prefetch to the last unpack,
        # as the planner counts storages
        key = (_storage_key(tensor), tensor.dtype)
        slot = next(
            (
                c
                for ref, c in self._dedupe.get(key, ())
                if ref() is not None and c.version == tensor._version and c.handles > 0
                and c.covers(tensor)
            ),
            None,
        )  # fmt: skip
        fresh, whole = slot is None, None
        if slot is None:
            # a view that does not fill its storage (x[1:], k of a fused qkv): the slot holds the
            # whole storage, so a larger view saved later shares it
            whole = whole_storage(tensor)
            slot = _Slot(tensor if whole is None else whole)
            slot.original = weakref.ref(tensor)  # reuse and version checks follow the saved
            self._dedupe.setdefault(key, []).append((weakref.ref(tensor.untyped_storage()), slot))
            self._device_bytes += slot.nbytes
            self._cache[id(slot)] = slot
        view = None  # the slot's own geometry, else a view inside the slot's memory
        if not fresh or whole is not None:
            view = (tensor.size(), tensor.stride(), int(tensor.storage_offset()) - slot.offset)
        assert self._active_group is not None
        slot.uses += 1
        slot.pending += 1
        slot.handles += 1
        handle = _Handle(slot, view)
        self._groups[self._active_group].append(weakref.ref(handle))
        weakref.finalize(handle, self._release, slot, self._active_group)
        if fresh:
            self._evict_to(self.config.cache_bytes)
        return handle

    def _evict_to(self, limit_bytes: int) -> None:
        """Evict least-recently-used cached tensors until the cache holds ``limit_bytes``."""
        while self._cache and sum(s.nbytes for s in self._cache.values()) > limit_bytes:
            _, slot = self._cache.popitem(last=False)
            self._to_host(slot)

    def _to_host(self, slot: _Slot) -> None:
        tensor = slot.device_tensor
        assert tensor is not None
        if slot.host is None:
            raw = self._slab.take(slot.nbytes)
            slot.host = raw.view(slot.dtype).view(-1)
            self._peak_host_bytes = max(self._peak_host_bytes, self._slab.live_bytes)
            if self._d2h_stream is not None:
                self._d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
            with _on(self._d2h_stream):
                src = memory_order(tensor) if slot.dense else tensor
                slot.host.view(src.shape).copy_(src, non_blocking=self._cuda)
                slot.event = self._d2h_stream.record_event() if self._d2h_stream else None
                if self._d2h_stream is not None:  # the allocator must not reuse it mid-copy
                    tensor.record_stream(self._d2h_stream)
            self._counters["d2h_bytes"] += slot.nbytes
            self._counters["d2h_count"] += 1
        slot.device_tensor = None
        self._device_bytes -= slot.nbytes

    def backward_entered(self, group: int, *, previous: bool) -> None:
        """Backward reached the outputs of offload group ``group``: prefetch it and, when the
        unit just before it in forward order is offloaded too (``previous``), that unit's group,
        so its copy overlaps this unit's backward (the planner predicts the same rule)."""
        if not self.config.prefetch:
            return
        for g in (group, group - 1) if previous else (group,):
            for ref in self._groups.get(g, ()):
                handle = ref()
                if handle is not None and handle.slot.device_tensor is None:
                    self._to_device(handle.slot)

    def _to_device(self, slot: _Slot) -> None:
        assert slot.host is not None, "a slot without device tensor has a host copy"
        original, storage = slot.original(), slot.storage()
        if storage is not None and (original is None or original._version == slot.version):
            geometry = (storage, slot.offset, slot.size, slot.stride)
            slot.device_tensor = alias_storage(*geometry, dtype=slot.dtype, device=slot.device)
            self._counters["still_resident"] += 1
            self._device_bytes += slot.nbytes
            return
        if self._h2d_stream is not None and slot.event is not None:
            self._h2d_stream.wait_event(slot.event)  # the device->host copy has landed
        with _on(self._h2d_stream):
            t = torch.empty(slot.size, dtype=slot.dtype, device=slot.device)
            t = t.as_strided(slot.size, slot.stride) if slot.dense else t
            dst = memory_order(t) if slot.dense else t
            dst.copy_(slot.host.view(dst.shape), non_blocking=self._cuda)
            slot.event = self._h2d_stream.record_event() if self._h2d_stream else None
        slot.device_tensor = t
        self._device_bytes += slot.nbytes
        self._counters["h2d_bytes"] += slot.nbytes
        self._counters["h2d_count"] += 1

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            if self.weights is not None:
                return self.weights.unpack(packed)  # type: ignore[no-any-return]
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
        slot.pending -= 1
        if slot.host is not None and slot.pending <= 0:
            # NOTE: fetched copy now autograd's; host copy kept (retain_graph may unpack again)
            slot.pending = slot.uses
            slot.device_tensor = None
            self._device_bytes -= slot.nbytes
        if packed.view is not None:
            size, stride, offset = packed.view
            return tensor.as_strided(size, stride, tensor.storage_offset() + offset)
        return tensor

    def _release(self, slot: _Slot, group: int) -> None:  # autograd dropped the handle
        slot.handles -= 1
        if slot.handles > 0:  # another saved view still needs the slot
            self._forget_dead_handles(group)
            return
        if self._cuda and slot.event is not None:
            # an unread prefetch may still read the slot: order its reuse after that copy
            torch.cuda.current_stream(self.device).wait_event(slot.event)
        if slot.device_tensor is not None:
            self._device_bytes -= slot.nbytes
            slot.device_tensor = None
        self._cache.pop(id(slot), None)
        shared = self._dedupe.get(slot.key, [])
        shared[:] = [(ref, c) for ref, c in shared if c is not slot]
        if not shared:
            self._dedupe.pop(slot.key, None)
        if slot.host is not None:
            self._slab.give_back(slot.nbytes)
            slot.host = None
        self._forget_dead_handles(group)

    def _forget_dead_handles(self, group: int) -> None:
        refs = [r for r in self._groups.get(group, ()) if r() is not None]
        if refs or group == self._active_group:
            self._groups[group] = refs
        else:
            self._groups.pop(group, None)

    def stats(self) -> PoolStats:
        return PoolStats(
            host_bytes=self._slab.live_bytes,
            device_bytes=self._device_bytes,
            peak_host_bytes=self._peak_host_bytes,
            slab_capacity_bytes=self._slab.capacity_bytes,
            live_slots=self._slab.live_slots + len(self._cache),
            **self._counters,
        )

    def host_buffers(self) -> list[torch.Tensor]:  # subtract from a count: device bytes only
        return [self._slab.buffer]

    def state_dict(self) -> dict[str, Any]:
        """Counters and the peak; live slots are per step and are not saved."""
        return {"counters": dict(self._counters), "peak_host_bytes": self._peak_host_bytes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._counters.update({k: int(v) for k, v in state["counters"].items()})
        self._peak_host_bytes = int(state["peak_host_bytes"])


def _storage_key(tensor: torch.Tensor) -> int:
    """The identity of a tensor's storage (works for fake tensors, unlike ``data_ptr``)."""
    return int(tensor.untyped_storage()._cdata)


def _on(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Run on a CUDA side stream; on CPU (no stream) just run."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
