"""Optimizer state in the host pool, for optimizer-in-backward.

ZeRO-Offload (Ren et al., USENIX ATC'21) keeps optimizer state in host memory; SuperNeurons'
Unified Tensor Pool (Wang et al., PPoPP'18 §3.2) treats device memory as a cache over pinned host
memory and prefetches one step ahead of backward. Applied to the optimizer of
optimizer-in-backward, where each parameter is stepped in its post-accumulate-grad hook:

* between steps the state tensors of a parameter (SGD's momentum, Adam's two moments) live in a
  preallocated (pinned on CUDA) host slab: :class:`~superneurons.memory.offload.slab.HostSlab`;
* in the parameter's hook the state is on the device for the step: prefetched on the pool's
  host->device stream when the *previous* parameter in backward order finished its step (one
  ahead, like the checkpoints), or fetched on demand for the first one; the step runs on the
  device, in place, as the optimizer wrote it;
* right after the step the state goes back device->host on the pool's other stream (CUDA events
  order every copy; no ``torch.cuda.synchronize()``) and its device copy is dropped, so no state
  byte stays on the device between parameters (``record_stream`` keeps the allocator from
  reusing it before the copy has read it).

Small state (below ``min_offload_bytes``: BatchNorm scales, biases) stays on the device, as the
tensor pool keeps small activations; the optimizer's ``step`` counters (0-dim, on the host for
non-capturable Adam) are never moved. On a CPU-only build the same code runs with synchronous
copies into a distinct host buffer, so CPU tests exercise every copy; under the fake-tensor
simulation the host slab is on ``meta`` and holds no bytes.

The backward order is learned from the previous step (a parameter whose hook fires twice starts
a new step); a parameter out of order is fetched on demand, so the order affects overlap only.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

from superneurons.memory.offload.slab import HostSlab
from superneurons.memory.planner.cost import MIN_STATE_OFFLOAD_BYTES

__all__ = ["MIN_STATE_OFFLOAD_BYTES", "HostOptimizerState", "HostStateStats"]

logger = logging.getLogger("superneurons.memory")


_COUNTERS: tuple[str, ...] = ("d2h_bytes", "h2d_bytes", "d2h_count", "h2d_count")
_COUNTERS += ("prefetch_hits", "demand_fetches", "steps")


@dataclass(frozen=True)
class HostStateStats:
    """A snapshot of the host optimizer state's accounting (bytes are tensor bytes)."""

    host_bytes: int  # state bytes held in the host slab
    resident_bytes: int  # state kept on the device (small tensors, step counters excluded)
    device_bytes: int  # host-managed state now on the device (0 between parameters' steps)
    peak_device_bytes: int  # most host-managed state on the device at once
    params: int  # parameters whose state is host-managed
    d2h_bytes: int
    h2d_bytes: int
    d2h_count: int
    h2d_count: int
    prefetch_hits: int  # steps whose state a prefetch had brought
    demand_fetches: int  # steps that fetched their state on demand
    steps: int  # parameter steps run


class _Entry:
    """One parameter: its optimizer, host copies of its state and their device copies."""

    __slots__ = ("param", "optimizer", "host", "device", "event", "fresh")

    def __init__(self, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        self.param = param
        self.optimizer = optimizer
        self.host: dict[str, torch.Tensor] = {}  # state key -> tensor in the slab
        self.device: dict[str, torch.Tensor] | None = None  # fetched copies (None: on host)
        self.event: Any = None  # CUDA event of the last copy that touched ``host``/``device``
        self.fresh = False  # ``device`` came from a prefetch not yet consumed


class HostOptimizerState:
    """Keeps per-parameter optimizer state in the host pool between the parameters' steps.

    Args:
        device: the device parameters and gradients live on.
        host_device: ``"cpu"`` (pinned when ``device`` is CUDA) or ``"meta"`` (simulation).
        capacity_bytes: initial slab size (the plan's ``optimizer_host_bytes``); it grows.
        streams: ``(device->host, host->device)`` CUDA streams to copy on (the tensor pool's);
            new ones are made on CUDA when not given; ignored elsewhere.
        min_offload_bytes: smaller state tensors stay on the device.
    """

    def __init__(
        self,
        *,
        device: torch.device | str,
        host_device: str = "cpu",
        capacity_bytes: int = 0,
        streams: tuple[Any, Any] | None = None,
        min_offload_bytes: int = MIN_STATE_OFFLOAD_BYTES,
    ) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        if self._cuda and streams is None:
            streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        self._d2h: Any = streams[0] if self._cuda and streams else None
        self._h2d: Any = streams[1] if self._cuda and streams else None
        self._slab = HostSlab(capacity_bytes, pinned=self._cuda, device=host_device)
        self.min_offload_bytes = min_offload_bytes
        self._entries: dict[int, _Entry] = {}
        self._order: list[int] = []  # ids of the parameters stepped in this backward, in order
        self._next: dict[int, int] = {}  # backward order of the previous step: id -> next id
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._device_bytes = 0
        self._peak_device_bytes = 0

    def manage(self, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Keep ``param``'s state in ``optimizer`` (its own, one parameter) on the host."""
        entry = _Entry(param, optimizer)
        self._entries[id(param)] = entry

        def rehome(_optimizer: torch.optim.Optimizer) -> None:
            self._rehome(entry)

        optimizer.register_load_state_dict_post_hook(rehome)
        self._rehome(entry)  # state an optimizer already holds (a resumed run)

    # --- the parameter's hook: before and after its step ----------------------------------------
    def before_step(self, param: torch.Tensor) -> None:
        """Bring ``param``'s state to the device and hand it to the optimizer."""
        key = id(param)
        if key in self._order:  # a second backward: remember this one's order for prefetch
            self._next = self._following(self._order)
            self._order = []
        self._order.append(key)
        entry = self._entries[key]
        if not entry.host:
            return  # no state yet (the first step creates it on the device) or all small
        if entry.device is None:
            self._counters["demand_fetches"] += 1
            self._fetch(entry)
        else:
            self._counters["prefetch_hits"] += 1
        assert entry.device is not None
        if self._cuda:
            current = torch.cuda.current_stream(self.device)
            if entry.event is not None:
                current.wait_event(entry.event)  # the host->device copy has landed
            for tensor in entry.device.values():
                tensor.record_stream(current)
        entry.optimizer.state[param].update(entry.device)
        entry.fresh = False

    def after_step(self, param: torch.Tensor) -> None:
        """Send ``param``'s updated state back to the host; prefetch the next parameter's."""
        entry = self._entries[id(param)]
        self._counters["steps"] += 1
        state = entry.optimizer.state[param]
        if not entry.host:
            self._adopt(entry, state)  # first step: state was created on the device
        if entry.host:
            self._send_back(entry, state)
        following = self._entries.get(self._next.get(id(param), -1))
        if following is not None and following.host and following.device is None:
            self._fetch(following)
            following.fresh = True

    def _following(self, order: list[int]) -> dict[int, int]:
        """Each parameter -> the next one after it in ``order`` whose state is on the host (the
        one to prefetch once its step is over)."""
        following: dict[int, int] = {}
        upcoming = -1
        for key in reversed(order):
            if upcoming >= 0:
                following[key] = upcoming
            if self._entries[key].host:
                upcoming = key
        return following

    # --- copies ---------------------------------------------------------------------------------
    def _adopt(self, entry: _Entry, state: dict[str, Any]) -> None:
        """Give each large state tensor of the parameter a slot in the host slab."""
        for name, tensor in state.items():
            if self._managed(entry.param, tensor):
                nbytes = tensor.numel() * tensor.element_size()
                raw = self._slab.take(nbytes)
                entry.host[name] = raw.view(tensor.dtype).view(tensor.shape)
        if entry.host:  # the device copies are the ones the optimizer just wrote
            entry.device = {name: state[name] for name in entry.host}
            self._count_device(sum(_nbytes(t) for t in entry.device.values()))

    def _managed(self, param: torch.Tensor, tensor: Any) -> bool:
        return (
            isinstance(tensor, torch.Tensor)
            and tensor.device == param.device
            and tensor.shape == param.shape
            and tensor.dim() > 0  # never the 0-dim ``step`` counters
            and _nbytes(tensor) >= max(self.min_offload_bytes, 1)
        )

    def _send_back(self, entry: _Entry, state: dict[str, Any]) -> None:
        device = {name: state[name] for name in entry.host}
        if self._d2h is not None:
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))  # the step is done
        with _on(self._d2h):
            for name, tensor in device.items():
                entry.host[name].copy_(tensor, non_blocking=self._cuda)
                if self._d2h is not None:  # the allocator must not reuse it mid-copy
                    tensor.record_stream(self._d2h)
            entry.event = self._d2h.record_event() if self._d2h is not None else None
        state.update(entry.host)
        nbytes = sum(_nbytes(t) for t in device.values())
        entry.device = None
        self._device_bytes -= nbytes
        self._counters["d2h_bytes"] += nbytes
        self._counters["d2h_count"] += len(device)

    def _fetch(self, entry: _Entry) -> None:
        if self._h2d is not None and entry.event is not None:
            self._h2d.wait_event(entry.event)  # the previous device->host copy has landed
        with _on(self._h2d):
            device = {
                name: torch.empty(host.shape, dtype=host.dtype, device=self.device)
                for name, host in entry.host.items()
            }
            for name, tensor in device.items():
                tensor.copy_(entry.host[name], non_blocking=self._cuda)
            entry.event = self._h2d.record_event() if self._h2d is not None else None
        entry.device = device
        nbytes = sum(_nbytes(t) for t in device.values())
        self._count_device(nbytes)
        self._counters["h2d_bytes"] += nbytes
        self._counters["h2d_count"] += len(device)

    def _count_device(self, nbytes: int) -> None:
        self._device_bytes += nbytes
        self._peak_device_bytes = max(self._peak_device_bytes, self._device_bytes)

    def _rehome(self, entry: _Entry) -> None:
        """Move state the optimizer holds on the device (loaded, or made outside a hook) to the
        host slab: ``Optimizer.load_state_dict`` casts state to the parameter's device."""
        state = entry.optimizer.state.get(entry.param)
        if not state:
            return
        on_device = {n: t for n, t in state.items() if self._managed(entry.param, t)}
        if (
            not on_device
            or set(on_device) == set(entry.host)
            and all(on_device[n] is entry.host[n] for n in on_device)
        ):
            return
        self.wait()
        if not entry.host:
            self._adopt(entry, state)
        else:
            entry.device = {n: state[n] for n in entry.host}
            self._count_device(sum(_nbytes(t) for t in entry.device.values()))
        self._send_back(entry, state)

    # --- accounting and state -------------------------------------------------------------------
    def wait(self) -> None:
        """Block the host until every copy into the host slab has landed (before reading the
        state on the host, e.g. ``state_dict``); a no-op off CUDA."""
        for entry in self._entries.values():
            if self._cuda and entry.event is not None:
                entry.event.synchronize()

    def stats(self) -> HostStateStats:
        host = sum(_nbytes(t) for e in self._entries.values() for t in e.host.values())
        resident = sum(
            _nbytes(t)
            for e in self._entries.values()
            for n, t in e.optimizer.state.get(e.param, {}).items()
            if isinstance(t, torch.Tensor) and t.dim() > 0 and n not in e.host
        )
        return HostStateStats(
            host_bytes=host,
            resident_bytes=resident,
            device_bytes=self._device_bytes,
            peak_device_bytes=self._peak_device_bytes,
            params=sum(1 for e in self._entries.values() if e.host),
            **self._counters,
        )

    def host_buffers(self) -> list[torch.Tensor]:
        """The slab buffer the host-held state lives in (subtract it from a live-storage count
        on CPU, where the host is the device)."""
        return [self._slab.buffer]

    def state_dict(self) -> dict[str, Any]:
        """Counters and the peak; the state itself is the optimizers' (``PlanHandle``)."""
        return {"counters": dict(self._counters), "peak_device_bytes": self._peak_device_bytes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._counters.update({k: int(v) for k, v in state["counters"].items()})
        self._peak_device_bytes = int(state["peak_device_bytes"])


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _on(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Run on a CUDA side stream; on CPU (no stream) just run."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
