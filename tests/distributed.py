"""Run a function on N gloo ranks (spawned processes, free port, hard timeout).

``run_ranks(fn, *args, world_size=2)`` spawns ``world_size`` processes, each of which sets one
torch thread, joins a gloo process group on a free localhost port, calls
``fn(rank, world_size, *args)`` and sends back its (picklable) return value. The list of
results is ordered by rank. A rank that raises makes the call fail with that rank's traceback;
a rank that hangs (e.g. a collective mismatch) makes it fail after ``timeout_s`` instead of
blocking the test run. ``fn`` must be a module-level function (spawn pickles it by name).
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["free_port", "run_ranks"]


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            # NOTE: bytes, not tensors: a queued tensor lives in shared memory that vanishes
            # when this process exits before the parent reads it.
            buffer = io.BytesIO()
            torch.save(fn(rank, world_size, *args), buffer)
            results.put((rank, "ok", buffer.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout_s: float = 60.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results by rank.

    Raises:
        AssertionError: a rank raised (its traceback is in the message) or did not finish
            within ``timeout_s`` seconds (all ranks are then killed).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, timeout_s, fn, args, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    outcome: dict[int, tuple[str, Any]] = {}
    try:
        while len(outcome) < world_size:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise AssertionError(
                    f"ranks {sorted(set(range(world_size)) - set(outcome))} did not finish "
                    f"within {timeout_s:.0f} s (hang or collective mismatch?)"
                )
            try:
                rank, status, value = results.get(timeout=min(remaining_s, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and all(r not in outcome for r in dead):
                    raise AssertionError(f"ranks {dead} died without reporting") from None
                continue
            outcome[rank] = (status, value)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    errors = {r: v for r, (s, v) in outcome.items() if s == "error"}
    if errors:
        details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise AssertionError(f"{len(errors)} rank(s) failed:\n{details}")
    import torch

    return [torch.load(io.BytesIO(outcome[r][1]), weights_only=False) for r in range(world_size)]
