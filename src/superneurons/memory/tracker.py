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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from superneurons.compat import custom_op_function

__all__ = ["MARKER", "LiveStorageTracker", "untracked"]

MARKER = "superneurons::op"  # + the event index: the profiler range of each op (``mark_ops``)

_PAUSED = threading.local()


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
            (:func:`superneurons.memory.workspace.op_scratch`).
        births / deaths: storage serial -> op index of its creation / release.
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
        self._live: dict[int, int] = {}  # storage address -> serial
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
        if tensor.device.type == "meta":
            return 0  # no device bytes (the simulation's stand-in for host-offloaded tensors)
        storage = tensor.untyped_storage()
        address = int(storage._cdata)
        if address in self._live:
            return 0
        # NOTE: addresses are reused after a free, so each registration gets a fresh serial.
        serial = len(self.nbytes)
        size = int(storage.nbytes())
        self._live[address] = serial
        self.nbytes[serial] = size
        self.births[serial] = self.event
        self.live_bytes += size
        weakref.finalize(storage, self._release, address, serial)
        return size

    def _release(self, address: int, serial: int) -> None:
        if self._live.get(address) == serial:
            del self._live[address]
            self.live_bytes -= self.nbytes[serial]
            self.deaths[serial] = self.event

    def _update_peak(self) -> None:
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_event = self.event

    def serial_of(self, tensor: torch.Tensor) -> int | None:
        """The serial of ``tensor``'s storage, or None if it is not tracked."""
        return self._live.get(int(tensor.untyped_storage()._cdata))

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
