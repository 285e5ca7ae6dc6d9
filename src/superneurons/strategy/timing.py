"""How long one call takes on a device: the one timer behind the network and codec measurements."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["time_call_s"]


def time_call_s(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``fn()`` takes. On CUDA the work is enqueued on the current stream, so it is
    timed by events (waiting on the end event, never a device-wide synchronize); elsewhere by
    the wall clock around the blocking call."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin
