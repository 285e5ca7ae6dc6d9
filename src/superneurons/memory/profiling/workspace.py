"""Convolution workspaces under a budget: count them, and cap them at what the plan leaves.

SuperNeurons (Wang et al., PPoPP'18 §3.4) gives each convolution the fastest cuDNN algorithm
whose workspace fits the memory left after the tensors the step needs. In PyTorch a cuDNN (or
cuBLAS) workspace is an allocation of the CUDA caching allocator that no tensor owns, so the
dispatch-level count the profile uses (:class:`~superneurons.memory.tracker.LiveStorageTracker`)
does not see it, while ``torch.cuda.max_memory_allocated`` does. What PyTorch lets us control
(read from torch 2.13's ``torch/backends/cudnn``, ``torch/cuda/memory.py`` and ATen's
``native/cudnn/Conv_v8.cpp``):

* ``torch.backends.cudnn.benchmark`` (default off): on, cuDNN times candidate engines for each
  new shape, each with its own workspace, and keeps the fastest (``benchmark_limit`` bounds how
  many algorithms the v7 API tries). Off, the first engine of cuDNN's heuristics that runs is
  kept. Either way the choice is cached per convolution shape for the process.
* ``torch.cuda.set_per_process_memory_fraction``: caps what the caching allocator may reserve.
  When a workspace allocation fails while an engine is being chosen, ATen catches the
  out-of-memory error and tries the next engine (v8 API: ``try_plans``/``try_configs``; with
  benchmark on, the candidates are first filtered to the largest free cached block and the
  workspace halved until it allocates; v7 API: ``AlgoIterator::try_all``): the only hook that
  makes the workspace depend on memory left. Any other allocation over the cap raises
  ``OutOfMemoryError``.
* ``deterministic`` / ``allow_tf32`` filter engines (which changes numerics), and the
  environment variables ``CUDNN_CONV_WSCAP_DBG`` (a cap in MiB read by cuDNN itself) and
  ``TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT`` are read once per process: not per plan.

Not controllable from PyTorch: the workspace of a given engine, the engine order of cuDNN's
heuristics, a per-layer budget, and re-selection of an engine already cached for a shape: on the
v8 path a cached engine runs without the fallback, so a cap set after the first step with those
shapes changes nothing, or raises ``OutOfMemoryError`` if that engine's workspace no longer
fits (the v7 path re-searches). Set the cap before the first step with the plan's shapes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from superneurons.compat import memory_fraction
from superneurons.errors import ConfigError
from superneurons.memory.tracker import MARKER, LiveStorageTracker

__all__ = [
    "WorkspaceLimit",
    "cpu_allocator_events",
    "cudnn_settings",
    "limit_workspace",
    "op_scratch",
    "profiler_nodes",
    "scratch_recorder",
    "untracked_peak_bytes",
]

logger = logging.getLogger("superneurons.memory")

_ENV = ("CUDNN_CONV_WSCAP_DBG", "TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT", "PYTORCH_CUDA_ALLOC_CONF")


def cudnn_settings() -> dict[str, Any]:
    """The cuDNN and allocator settings that decide workspaces, for benchmark records."""
    cudnn = torch.backends.cudnn
    settings: dict[str, Any] = {
        "cudnn_available": bool(cudnn.is_available()),
        "benchmark": bool(cudnn.benchmark),
        "deterministic": bool(cudnn.deterministic),
        "allow_tf32": bool(cudnn.allow_tf32),
        "env": {name: os.environ.get(name) for name in _ENV},
    }
    if torch.cuda.is_available():
        settings["cudnn_version"] = cudnn.version()
        settings["benchmark_limit"] = cudnn.benchmark_limit
        settings["memory_fraction"] = memory_fraction()
    return settings


def untracked_peak_bytes(
    step: Callable[[], None],
    *,
    resident: Sequence[torch.Tensor] = (),
    device: torch.device | str | None = None,
) -> int:
    """Bytes the device peak of ``step()`` holds beyond every live tensor: on CUDA,
    ``max_memory_allocated`` of one step minus the live-storage peak of the same step (cuDNN and
    cuBLAS workspaces, the allocator's 512-byte rounding). 0 on a CPU device, where no workspace
    is allocated through the tensor allocator this project can see.

    ``resident`` (parameters, optimizer state, inputs) is registered with the live count, as
    both figures include it. Run it on a warmed-up step, so cuDNN's engines are chosen.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return 0
    tracker = LiveStorageTracker()
    tracker.register(resident)
    torch.cuda.reset_peak_memory_stats(device)
    with tracker:
        step()
    done = torch.cuda.Event()
    done.record()
    done.synchronize()  # max_memory_allocated counts frees at enqueue time; wait for the step
    return max(0, int(torch.cuda.max_memory_allocated(device)) - int(tracker.peak_bytes))


def scratch_recorder(enabled: bool) -> Any:
    """A ``torch.profiler`` session recording the CPU allocator's events (``profile_memory``),
    or a null context: :func:`op_scratch` reads it."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], profile_memory=True)


def op_scratch(recording: Any) -> dict[int, int]:
    """Per event of a recorded CPU step, the scratch its op allocated for itself: the most the
    op's own allocations held at once beyond those still live when it returned (its outputs).

    Kernels allocate such buffers below the dispatcher (CPU flash attention's per-thread blocks
    of scores, a convolution's im2col), so no live-tensor count sees them. The ops are the
    ranges :class:`~superneurons.memory.tracker.LiveStorageTracker` marks (``mark_ops``). Frees
    inside a range of memory the op did not allocate (Python's garbage collector can run there,
    when the range's own objects are created) are not the op's: allocations are matched to
    frees by address, so the figure does not depend on the process's history.
    """
    if recording is None or not hasattr(recording, "profiler"):
        return {}
    scratch = {}
    for node in _marked_ops(recording.profiler.kineto_results.experimental_event_tree()):
        extra = _held_beyond_outputs([(ptr, size) for _, ptr, size in cpu_allocator_events([node])])
        if extra > 0:
            scratch[int(node.name[len(MARKER) :])] = extra
    return scratch


def profiler_nodes(roots: Sequence[Any]) -> Iterator[Any]:
    """Every node of the profiler's event trees under ``roots``
    (``kineto_results.experimental_event_tree()`` or subtrees), depth first."""
    stack = list(roots)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children)


def _marked_ops(roots: Sequence[Any]) -> list[Any]:
    """The profiler's nodes of the ranges named :data:`MARKER` + an event index."""
    return [node for node in profiler_nodes(roots) if node.name.startswith(MARKER)]


def cpu_allocator_events(nodes: Sequence[Any]) -> list[tuple[int, int, int]]:
    """``(time_ns, address, bytes)`` of every CPU allocator event under the profiler's event-tree
    ``nodes`` (:func:`profiler_nodes`), in time order; negative bytes: a free.

    The allocator sizes a free from a table of addresses that it fills only while a profiler
    runs and empties only at frees seen while one runs; a block allocated under one profiler and
    freed outside it leaves its size behind, and a block later allocated at that address outside
    a profiler is reported freed with the old size. Callers that sum sizes pair each free with
    the allocation of the same address they saw (see :func:`_held_beyond_outputs`).
    """
    events = []
    for order, node in enumerate(profiler_nodes(nodes)):
        fields = node.extra_fields  # allocator events carry an address and a size
        if hasattr(fields, "alloc_size") and fields.device.type == "cpu":
            events.append((node.start_time_ns, order, fields.ptr, fields.alloc_size))
    return [(time_ns, ptr, nbytes) for time_ns, _, ptr, nbytes in sorted(events)]


def _held_beyond_outputs(events: Sequence[tuple[int, int]]) -> int:
    """The most ``events``' own allocations held at once, less what they still hold at the
    end; a free of an address allocated before the first event is not counted."""
    live: dict[int, int] = {}
    held = highest = 0
    for ptr, nbytes in events:
        if nbytes > 0:
            live[ptr] = live.get(ptr, 0) + nbytes
            held += nbytes
            highest = max(highest, held)
        else:
            held -= live.pop(ptr, 0)
    return highest - held


class WorkspaceLimit:
    """A cap on the caching allocator while a plan runs; :meth:`remove` restores the settings.

    Attributes:
        cap_bytes: the bytes the allocator may reserve on ``device`` (0 = not capped: CPU).
        fraction: ``cap_bytes`` as a fraction of the device's memory.
    """

    def __init__(self, *, device: torch.device, cap_bytes: int) -> None:
        self.device = device
        self.cap_bytes = 0
        self.fraction = 1.0
        self._previous: tuple[float, bool] | None = None
        if device.type != "cuda":
            logger.debug("workspace limit: no-op on %s (no cuDNN workspaces)", device)
            return
        total = torch.cuda.get_device_properties(device).total_memory
        if not 0 < cap_bytes <= total:
            raise ConfigError(
                f"workspace cap {cap_bytes} bytes must be in (0, {total}] (the device's memory)"
            )
        self.cap_bytes = cap_bytes
        self.fraction = cap_bytes / total
        self._previous = (
            memory_fraction(device),
            torch.backends.cudnn.benchmark,
        )
        # NOTE: benchmark mode times every candidate engine with its own workspace; without
        # it the first heuristic engine whose workspace allocation succeeds is kept.
        torch.backends.cudnn.benchmark = False
        torch.cuda.set_per_process_memory_fraction(self.fraction, device)
        logger.info(
            "allocator capped at %d bytes (%.3f of %s): cuDNN workspaces get what is left",
            cap_bytes,
            self.fraction,
            device,
        )

    def remove(self) -> None:
        """Restore the memory fraction and ``cudnn.benchmark`` (idempotent)."""
        if self._previous is None:
            return
        fraction, benchmark = self._previous
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)
        torch.backends.cudnn.benchmark = benchmark
        self._previous = None

    def __enter__(self) -> WorkspaceLimit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def limit_workspace(*, cap_bytes: int, device: torch.device | str | None = None) -> WorkspaceLimit:
    """Cap the device's caching allocator at ``cap_bytes`` (e.g. the plan's budget) so that
    convolution workspaces get what the plan's tensors leave; a no-op on CPU.

    Use it around the steps a plan runs, set before the first step with those shapes (cuDNN's
    engine choice is cached per shape): ``with apply_plan(model, plan),
    limit_workspace(cap_bytes=plan.budget_bytes): ...``. An allocation of the step's own
    tensors over the cap raises ``torch.OutOfMemoryError``: the cap is a hard limit.
    """
    where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return WorkspaceLimit(device=where, cap_bytes=cap_bytes)
