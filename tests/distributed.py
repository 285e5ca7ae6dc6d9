"""Run functions on N gloo ranks (forked processes, free port, hard timeout).

``run_ranks(fn, *args, world_size=2)`` starts ``world_size`` processes that set one torch
thread, join a gloo process group on a free localhost port and call
``fn(rank, world_size, *args)``; it returns the results ordered by rank. A rank that raises
makes the call fail with that rank's traceback; a rank that hangs (e.g. a collective mismatch)
makes it fail after ``timeout_s`` instead of blocking the test run.

Starting ranks costs seconds (each imports torch), so ranks fork from one server per test
process that imported torch once (:func:`superneurons.train.launch.forkserver_for_ranks`),
:class:`Ranks` keeps a group alive across calls (``with Ranks(2) as ranks: ranks.run(fn_a);
ranks.run(fn_b)``) and :func:`shared_ranks` shares one group across test modules. After a
failed or timed-out call the group is torn down and the next call starts a fresh one. ``fn``
must be a module-level function (it is pickled by name); results travel as ``torch.save``
bytes."""

from __future__ import annotations

import atexit
import datetime
import io
import os
import queue
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

from superneurons.train.launch import forkserver_for_ranks, free_port

__all__ = ["Ranks", "free_port", "run_ranks", "shared_ranks"]


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
        )
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            # NOTE: bytes, not tensors: a queued tensor lives in shared memory that vanishes
            # when this process exits before the parent reads it.
            buffer = io.BytesIO()
            torch.save(fn(rank, world_size, *args), buffer)
            results.put((rank, "ok", buffer.getvalue()))
        except BaseException:  # noqa: BLE001
            results.put((rank, "error", traceback.format_exc()))
    from superneurons.train.rank import exit_rank

    results.close()
    results.join_thread()  # every result is in the pipe before the process goes
    exit_rank(0)  # barrier, destroy, no interpreter finaliser beside gloo's threads


class Ranks:
    """A live group of ``world_size`` gloo ranks that runs functions on demand."""

    def __init__(self, world_size: int = 2) -> None:
        self.world_size = world_size
        self._procs: list[Any] = []

    def __enter__(self) -> Ranks:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _start(self) -> None:
        ctx = forkserver_for_ranks("superneurons.train.rank")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(rank, self.world_size, port, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()

    def close(self, *, graceful: bool = True) -> None:
        if graceful:
            for tasks in getattr(self, "_tasks", []):
                tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=0.5 if graceful else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs = []

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every rank; results by rank.

        Raises:
            AssertionError: a rank raised (traceback in the message) or did not finish
                within ``timeout_s`` (the group is then killed).
        """
        import torch

        if not self._procs:
            self._start()
        for tasks in self._tasks:
            tasks.put((fn, args))
        deadline = time.monotonic() + timeout_s
        outcome: dict[int, tuple[str, Any]] = {}
        while len(outcome) < self.world_size:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                self.close(graceful=False)
                missing = sorted(set(range(self.world_size)) - set(outcome))
                # a rank that raised first often leaves the others waiting in a collective
                details = "".join(
                    f"\n--- rank {r} raised ---\n{v}"
                    for r, (s, v) in sorted(outcome.items())
                    if s == "error"
                )
                raise AssertionError(
                    f"ranks {missing} did not finish within {timeout_s:.0f} s "
                    f"(hang or collective mismatch?){details}"
                )
            try:
                rank, status, value = self._results.get(timeout=min(remaining_s, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    self.close(graceful=False)
                    raise AssertionError(f"ranks {dead} died without reporting") from None
                continue
            outcome[rank] = (status, value)
        errors = {r: v for r, (s, v) in outcome.items() if s == "error"}
        if errors:
            self.close(graceful=False)
            details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{len(errors)} rank(s) failed:\n{details}")
        return [
            torch.load(io.BytesIO(outcome[r][1]), weights_only=False)
            for r in range(self.world_size)
        ]


def run_ranks(
    fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout_s: float = 60.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` once on a fresh group of ``world_size`` ranks."""
    with Ranks(world_size) as ranks:
        return ranks.run(fn, *args, timeout_s=timeout_s)


_SHARED: dict[int, Ranks] = {}


def shared_ranks(world_size: int = 2) -> Ranks:
    """One live group per world size for the whole test session (closed at exit), so test
    modules do not each pay the seconds it takes to start ranks."""
    if world_size not in _SHARED:
        _SHARED[world_size] = Ranks(world_size)
        atexit.register(_SHARED[world_size].close)
    return _SHARED[world_size]
