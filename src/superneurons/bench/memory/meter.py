"""How the memory benchmark measures one training step: device peak and step time.

* **CPU** (``device="cpu"``): the peak is the c10 CPU allocator's (:func:`allocator_peak_bytes`:
  every allocation and free the allocator reports to ``torch.profiler``, so kernel scratch
  buffers and what ``torch.compile``'s generated code allocates below the dispatcher are in it)
  of one steady-state step on top of the resident tensors; the dispatch-level live-storage count
  (:func:`device_peak_bytes`, what the planner predicts, host buffers such as the tensor pool's
  slab subtracted) is reported beside it. Time is the median wall time of ``steps`` unmeasured
  steps, with the process CPU time beside it.
* **CUDA**: the peak is ``torch.cuda.max_memory_allocated`` over one steady-state step, with the
  peak statistics reset after the warm-up (cuDNN workspaces, allocator rounding and everything
  else the caching allocator serves are in it; pinned host memory is not); time is the median
  of ``steps`` steps timed by CUDA events on the current stream.

Every figure includes the resident state (parameters, gradients, optimizer state, the batch),
as the planner's ``predicted_peak_bytes`` does.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from superneurons.memory.profiling.workspace import cpu_allocator_events, profiler_nodes
from superneurons.memory.tracker import LiveStorageTracker, plain_tensors

__all__ = [
    "StepMeasure",
    "allocator_peak_bytes",
    "allocator_step_bytes",
    "allocator_timeline_bytes",
    "device_peak_bytes",
    "events_timeline_bytes",
    "measure_step",
]

StepFn = Callable[[], None]


@dataclass(frozen=True)
class StepMeasure:
    """One method's measured step. ``cpu_s`` is process CPU time and ``tracked_peak_bytes`` the
    live-storage view of the same step (CPU device only)."""

    peak_bytes: int
    step_s: float
    cpu_s: float | None = None
    tracked_peak_bytes: int | None = None

    def as_record(self) -> dict[str, float | int | None]:
        return {
            "peak_bytes": self.peak_bytes,
            "step_s": self.step_s,
            "step_cpu_s": self.cpu_s,
            "tracked_peak_bytes": self.tracked_peak_bytes,
        }


def device_peak_bytes(
    step: StepFn, *, resident: Sequence[torch.Tensor], host: Sequence[torch.Tensor] = ()
) -> int:
    """Live-storage peak of ``step()`` on top of ``resident`` tensors, ``host`` buffers excluded.

    ``host`` (e.g. ``handle.pool.host_buffers()``) is registered first and subtracted: pinned
    host memory is not device memory. Pass fresh sequences (``resident=[...]``): the meter
    drops its references before the step, so the step can free what it frees in a loop.
    """
    tracker = LiveStorageTracker()
    host_bytes = tracker.register(host)
    tracker.register(resident)
    del resident, host  # the step may free them (a loop's previous outputs): hold no reference
    with tracker:
        step()
    return int(tracker.peak_bytes - host_bytes)


def allocator_peak_bytes(step: StepFn, *, resident: Callable[[], Sequence[torch.Tensor]]) -> int:
    """Peak bytes of the c10 CPU allocator over one ``step()`` (:func:`allocator_step_bytes`)."""
    return allocator_step_bytes(step, resident=resident)[0]


def allocator_step_bytes(
    step: StepFn, *, resident: Callable[[], Sequence[torch.Tensor]]
) -> tuple[int, int]:
    """``(peak, unfreed)`` bytes of the c10 CPU allocator over one ``step()``, on top of
    ``resident()`` (:func:`allocator_timeline_bytes`).

    ``unfreed`` is what the step allocated and the profiler saw no free of: 0 for a
    steady-state step. Not 0 when a free ran on a thread the profiler does not record: a gloo
    worker thread that drops the last reference to a collective's tensor after the collective
    (seen with FSDP2 on gloo: one block of a layer's unsharded size, now and then); the peak
    may then be over-counted by up to those bytes, and a caller can measure again.
    """
    timeline = allocator_timeline_bytes(step, resident=resident)
    return max(timeline), timeline[-1] - timeline[0]


def allocator_timeline_bytes(
    step: StepFn, *, resident: Callable[[], Sequence[torch.Tensor]]
) -> list[int]:
    """The c10 CPU allocator's bytes over one ``step()``, on top of ``resident()``: the first
    value is the resident bytes, then one value after each allocation and free of the step.

    ``torch.profiler`` with ``profile_memory=True`` records every allocation and free the CPU
    allocator serves (``[memory]`` events, with their address): tensors, the scratch buffers
    kernels allocate for themselves (flash attention's, a reduction's), and what inductor's
    generated code allocates, none of which a dispatch-level count sees. ``step()`` runs twice
    under it: once to allocate what a loop carries from step to step (a previous step's
    ``outputs``), then the measured step, marked with ``record_function``. Each value is the
    storage bytes of ``resident()`` and of their ``.grad`` at the start of the measured step
    (parameters, optimizer state, the batch: what is alive and never freed) plus the running sum
    of the measured step's events so far. A free counts only when this profiler run saw its
    address allocated, with that allocation's size: blocks allocated before the profiler and
    freed by the step are not subtracted (the timeline can only be over-counted by them), and
    the sizes the allocator reports for them, stale after earlier profiler runs in the process
    (:func:`~superneurons.memory.profiling.workspace.cpu_allocator_events`), are never read.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    marker = "superneurons::measured_step"
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()  # what this step allocates and the next frees is known to the profiler
        base = _storage_bytes(resident())
        with record_function(marker):
            step()
    roots = prof.profiler.kineto_results.experimental_event_tree()  # type: ignore[union-attr]
    window_ns = _window_ns(roots, marker)
    return events_timeline_bytes(cpu_allocator_events(roots), base_bytes=base, window_ns=window_ns)


def events_timeline_bytes(
    events: Sequence[tuple[int, int, int]], *, base_bytes: int, window_ns: tuple[int, int]
) -> list[int]:
    """``base_bytes``, then the running bytes after each of ``events`` (``(time_ns, address,
    bytes)`` in time order, negative: a free, as
    :func:`~superneurons.memory.profiling.workspace.cpu_allocator_events` reads them) inside
    ``window_ns`` (start and end, inclusive). A free is paired with the last allocation of its
    address among ``events`` (inside the window or before it) and counts that allocation's size;
    a free of an address ``events`` never allocated counts nothing, whatever size it carries.
    """
    start_ns, end_ns = window_ns
    live: dict[int, int] = {}  # address -> bytes of the blocks allocated among the events
    timeline = [base_bytes]
    for time_ns, ptr, nbytes in events:
        if nbytes > 0:
            live[ptr] = nbytes
        else:
            nbytes = -live.pop(ptr, 0)
        if nbytes and start_ns <= time_ns <= end_ns:
            timeline.append(timeline[-1] + nbytes)
    return timeline


def _window_ns(roots: Sequence[Any], name: str) -> tuple[int, int]:
    """Start and end (ns) of the profiler's range called ``name``."""
    for node in profiler_nodes(roots):
        if node.name == name:
            return node.start_time_ns, node.end_time_ns
    raise RuntimeError(f"the profiler recorded no range {name!r}")


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct cpu storages of ``tensors`` and of their gradients."""
    alive = [*tensors, *(t.grad for t in tensors if t.is_leaf and t.grad is not None)]
    alive = [plain for t in alive for plain in plain_tensors(t)]  # a DTensor: this rank's shard
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in alive
        if t.device.type == "cpu"
    }
    return sum(storages.values())


def measure_step(
    step: StepFn,
    *,
    device: torch.device,
    steps: int,
    resident: Callable[[], Sequence[torch.Tensor]],
    host: Callable[[], Sequence[torch.Tensor]] = tuple,
    warmup: int = 1,
) -> StepMeasure:
    """Warm up (optimizer state, the pool's slab, cuDNN engines), then measure one step's peak
    and the median time of ``steps`` more. ``resident``/``host`` are read after the warm-up."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        return _measure_cuda(step, device, steps)
    tracked = device_peak_bytes(step, resident=resident(), host=host())
    peak = allocator_peak_bytes(step, resident=resident)
    walls, cpus = [], []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return StepMeasure(peak, statistics.median(walls), statistics.median(cpus), tracked)


def _measure_cuda(step: StepFn, device: torch.device, steps: int) -> StepMeasure:
    _wait(device)  # the warm-up's frees are settled before the peak is reset
    torch.cuda.reset_peak_memory_stats(device)
    step()
    _wait(device)
    peak = int(torch.cuda.max_memory_allocated(device))
    pairs = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        pairs.append((start, end))
    pairs[-1][1].synchronize()
    return StepMeasure(peak, statistics.median(s.elapsed_time(e) / 1e3 for s, e in pairs))


def _wait(device: torch.device) -> None:
    """Wait for the work queued on ``device``'s current stream (an event, not a device sync:
    the pool's side streams are joined by the compute stream before it reads their copies)."""
    with torch.cuda.device(device):
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
