"""How the memory benchmark measures one training step: device peak and step time.

* **CPU** (``device="cpu"``): the peak is the dispatch-level live-storage count
  (:class:`~superneurons.memory.tracker.LiveStorageTracker`) of one steady-state step, host
  buffers (the tensor pool's slab) subtracted, i.e. what a GPU would hold; time is the median
  wall time of ``steps`` untracked steps, with the process CPU time beside it.
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

import torch

from superneurons.memory.tracker import LiveStorageTracker

__all__ = ["StepMeasure", "device_peak_bytes", "measure_step"]

StepFn = Callable[[], None]


@dataclass(frozen=True)
class StepMeasure:
    """One method's measured step. ``cpu_s`` is process CPU time (CPU device only)."""

    peak_bytes: int
    step_s: float
    cpu_s: float | None = None

    def as_record(self) -> dict[str, float | int | None]:
        return {"peak_bytes": self.peak_bytes, "step_s": self.step_s, "step_cpu_s": self.cpu_s}


def device_peak_bytes(
    step: StepFn, *, resident: Sequence[torch.Tensor], host: Sequence[torch.Tensor] = ()
) -> int:
    """Live-storage peak of ``step()`` on top of ``resident`` tensors, ``host`` buffers excluded.

    ``host`` (e.g. ``handle.pool.host_buffers()``) is registered first and subtracted: pinned
    host memory is not device memory.
    """
    tracker = LiveStorageTracker()
    host_bytes = tracker.register(host)
    tracker.register(resident)
    with tracker:
        step()
    return int(tracker.peak_bytes - host_bytes)


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
    peak = device_peak_bytes(step, resident=resident(), host=host())
    walls, cpus = [], []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return StepMeasure(peak, statistics.median(walls), statistics.median(cpus))


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
