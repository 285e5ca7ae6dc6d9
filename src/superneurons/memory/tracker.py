"""Dispatch-level live-storage accounting: the device bytes a step really holds.

:class:`LiveStorageTracker` is a ``TorchDispatchMode`` that sees every aten op, registers each new
untyped storage among the op's outputs with its byte size, and un-registers it through a weakref
finalizer when PyTorch releases it. The running sum is the live device memory the caching
allocator would have to serve (without its rounding and fragmentation, cuDNN workspaces or the
CUDA context, which no CPU run models). It works with real tensors and under ``FakeTensorMode``
(fake storages carry their byte size and die like real ones).

Operators defined with ``torch.library.custom_op`` (PyTorch's chunked
``F.linear_cross_entropy`` is one) are traced through: their Python implementation runs inside
the mode, so their working buffers are counted as every other op's
(:func:`superneurons.compat.custom_op_function`); seen as one op, they would be invisible.

Storages that change size in place are followed too: FSDP2 frees an unsharded parameter with
``untyped_storage().resize_(0)`` after its forward and re-allocates it with ``resize_(n)`` before
backward (``torch.distributed.fsdp``'s ``free_storage``/``alloc_storage``), a call that never
reaches the dispatcher. While a tracker is active ``UntypedStorage.resize_`` reports to it: a
resize ends the storage's current serial and starts a new one of the new size (``lineage`` maps
every serial to the first serial of its storage). Tensor subclasses that wrap plain tensors
(``DTensor``: a sharded parameter, its gradient, its optimizer state) are counted by their inner
tensors, the bytes this rank really holds, not by the global shape their own storage reports.

Measured here: it agrees with ``torch.distributed._tools.mem_tracker.MemTracker``
within 0.5% on small models and is ~50x faster (a 590-layer ResNet step: 22 s vs > 21 min), because
it does no per-module bookkeeping: one dict insert per new storage.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from superneurons.compat import custom_op_function

__all__ = ["MARKER", "LiveStorageTracker", "plain_tensors", "untracked"]

MARKER = "superneurons::op"  # + the event index: the profiler range of each op (``mark_ops``)

_PAUSED = threading.local()
_ACTIVE: list[LiveStorageTracker] = []  # trackers entered now (the resize_ patch reports to them)
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


def _reporting_resize(storage: torch.UntypedStorage, nbytes: int) -> Any:
    out = _ORIGINAL_RESIZE(storage, nbytes)
    if not getattr(_PAUSED, "depth", 0):
        # NOTE: every active tracker, whatever thread resizes: on CUDA, backward (FSDP2's
        # pre-backward all-gather included) runs on autograd's device thread, where the
        # dispatch mode follows the ops but a thread-local list would not
        for tracker in {id(t): t for t in _ACTIVE}.values():
            tracker._resized(storage)
    return out


def plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """``tensor`` itself, or for a wrapper subclass (``DTensor``) the plain tensors it holds."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = [getattr(tensor, name) for name in names]  # DTensor's include its device mesh
    return [leaf for t in inner if isinstance(t, torch.Tensor) for leaf in plain_tensors(t)]


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """Ops run in this block, on this thread, are invisible to every tracker: the runtime's
    host-side work (the host optimizer's copies and step), which on a CPU-only build runs on
    the same device as the model but is not device memory."""
    _PAUSED.depth = getattr(_PAUSED, "depth", 0) + 1
    try:
        yield
    finally:
        _PAUSED.depth -= 1


class LiveStorageTracker(TorchDispatchMode):
    """Count live untyped storages, op by op.

    Attributes:
        event: index of the last op seen (-1 before the first).
        live_bytes: bytes of storages alive now (registered ones included).
        peak_bytes: the largest ``live_bytes`` seen right after an op's outputs were created.
        peak_event: the op index of that peak.
        timeline_bytes: ``live_bytes`` after each op (``record_timeline=True``).
        mark_ops: wrap each op in a ``torch.profiler`` range named :data:`MARKER` + its event
            index, so a profiler's allocator events can be placed on the events
            (:func:`superneurons.memory.profiling.workspace.op_scratch`).
        births / deaths: storage serial -> op index of its creation / release (a ``resize_``
            releases the old serial and creates a new one).
        lineage: storage serial -> the first serial of the same storage object (itself unless
            the storage was resized).
        nbytes: storage serial -> its size in bytes, for every storage seen (serials are
            0, 1, 2, ... in registration order).
    """

    def __init__(
        self,
        *,
        record_timeline: bool = False,
        on_op: Callable[[int, Any, Any, Any, Any], None] | None = None,
        mark_ops: bool = False,
    ) -> None:
        super().__init__()
        self.mark_ops = mark_ops
        self.event = -1
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_event = -1
        self.record_timeline = record_timeline
        self.timeline_bytes: list[int] = []
        self.births: dict[int, int] = {}
        self.deaths: dict[int, int] = {}
        self.nbytes: dict[int, int] = {}
        self.lineage: dict[int, int] = {}
        self._live: dict[int, int] = {}  # storage address -> serial
        self._roots: dict[int, int] = {}  # address of a resized storage -> its first serial
        self._on_op = on_op

    # --- registration -------------------------------------------------------------------------
    def register(self, tensors: Iterable[torch.Tensor]) -> int:
        """Count storages that existed before tracking began (parameters, inputs, state).

        Returns the bytes newly registered.
        """
        added = 0
        for tensor in tensors:
            added += self._track(tensor)
        self._update_peak()
        return added

    def _track(self, tensor: torch.Tensor) -> int:
        if is_traceable_wrapper_subclass(tensor):
            return sum(self._track(inner) for inner in plain_tensors(tensor))
        if tensor.device.type == "meta":
            return 0  # no device bytes (the simulation's stand-in for host-offloaded tensors)
        storage = tensor.untyped_storage()
        address = int(storage._cdata)
        if address in self._live:
            return 0
        return self._add(storage, address, int(storage.nbytes()))

    def _add(self, storage: torch.UntypedStorage, address: int, size: int) -> int:
        # NOTE: addresses are reused after a free, so each registration gets a fresh serial.
        serial = len(self.nbytes)
        self._live[address] = serial
        self.nbytes[serial] = size
        self.births[serial] = self.event
        self.lineage[serial] = self._roots.get(address, serial)
        self.live_bytes += size
        weakref.finalize(storage, self._release, address, serial)
        return size

    def _release(self, address: int, serial: int, *, resized: bool = False) -> None:
        if self._live.get(address) == serial:
            del self._live[address]
            self.live_bytes -= self.nbytes[serial]
            self.deaths[serial] = self.event
        if not resized:  # the storage object itself is gone: its address may be reused
            self._roots.pop(address, None)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """``storage.resize_`` ran: its old bytes die now and its new bytes (if any) are born."""
        address = int(storage._cdata)
        size = int(storage.nbytes())
        serial = self._live.get(address)
        if serial is not None:
            if self.nbytes[serial] == size:
                return
            self._roots.setdefault(address, self.lineage[serial])
            self._release(address, serial, resized=True)
        if size > 0:
            if address not in self._roots:  # first seen by this resize: its own root
                self._roots[address] = len(self.nbytes)
            self._add(storage, address, size)
        self._update_peak()

    def __enter__(self) -> LiveStorageTracker:
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _reporting_resize  # type: ignore[method-assign,assignment]
        _ACTIVE.append(self)
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE  # type: ignore[method-assign]
        super().__exit__(*exc)

    def _update_peak(self) -> None:
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_event = self.event

    def serial_of(self, tensor: torch.Tensor) -> int | None:
        """The serial of ``tensor``'s storage (a wrapper subclass's first inner tensor's), or None
        if it is not tracked."""
        plain = plain_tensors(tensor)
        if not plain:
            return None
        return self._live.get(int(plain[0].untyped_storage()._cdata))

    def is_live(self, serial: int) -> bool:
        return serial not in self.deaths

    # --- dispatch -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(_PAUSED, "depth", 0):
            return func(*args, **(kwargs or {}))
        inner = custom_op_function(func)
        if inner is not None:  # its own ops come back through this mode, one event each
            with self:
                return inner(*args, **(kwargs or {}))
        if self.mark_ops:  # a profiler marker per op: its allocator events fall inside it
            with torch.autograd.profiler.record_function(f"{MARKER}{self.event + 1}"):
                out = func(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        self.event += 1
        leaves, _ = tree_flatten(out)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        self._update_peak()
        if self.record_timeline:
            self.timeline_bytes.append(self.live_bytes)
        if self._on_op is not None:
            self._on_op(self.event, func, args, kwargs, out)
        return out
