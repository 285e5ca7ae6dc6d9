"""Shared by the ``superneurons train`` tests: the small MLP run on Fashion-MNIST, one rank's
training (run in spawned ranks) and reading a rank's checkpoint back."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from superneurons.optim.stepcost import ComputeTimes, OptimizerTimes
from superneurons.train.checkpoint import checkpoint_path
from superneurons.train.config import TrainConfig

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
needs_data = pytest.mark.skipif(
    not FASHION_MNIST.exists(), reason="Fashion-MNIST IDX files not installed"
)


def mlp_config(out_dir: Path, **overrides: Any) -> TrainConfig:
    """Three logged steps of the MLP on Fashion-MNIST, batch 16, into ``out_dir``."""
    base: dict[str, Any] = {
        "model": "mlp",
        "data": "fashion-mnist",
        "out_dir": str(out_dir),
        "batch_size": 16,
        "limit_steps": 3,
        "log_every": 1,
    }
    return TrainConfig(**{**base, **overrides})


def run_rank(rank: int, world_size: int, config: TrainConfig) -> dict[str, Any]:
    """One rank's training run on the CPU (for ``Ranks.run``); returns its summary."""
    from superneurons.train.loop import run_training

    return run_training(config, torch.device("cpu"))


# What auto (Adam) measures on this device, stated instead so that a decision a test checks
# depends on nothing but its inputs: the MLP's backward and optimizer steps as
# superneurons.optim.stepcost.measure_compute timed them here (batch 16, one thread, load
# average ~4; medians of 5, rounded): 1-bit Adam's steps are slower than AdamW's.
STATED_COMPUTE = ComputeTimes(
    backward_s=0.002,
    optimizer=OptimizerTimes(adamw_s=0.004, warmup_s=0.012, compressed_s=0.020),
)


def run_rank_stated(rank: int, world_size: int, config: TrainConfig) -> dict[str, Any]:
    """:func:`run_rank` with ``auto`` (Adam) taking :data:`STATED_COMPUTE` instead of
    measuring (the rank processes are shared: the measurement is put back afterwards)."""
    from superneurons.optim import autoadam

    measure = autoadam.measure_compute
    autoadam.measure_compute = lambda *_args, **_kwargs: STATED_COMPUTE  # type: ignore[assignment]
    try:
        return run_rank(rank, world_size, config)
    finally:
        autoadam.measure_compute = measure


def run_rank_planning_fails_on(
    rank: int, world_size: int, config: TrainConfig, failing_rank: int
) -> tuple[str, str]:
    """:func:`run_rank` where ``failing_rank``'s planner finds the budget infeasible (if it
    plans);
    returns ``(exception type, message)`` of what the run raised on this rank."""
    from superneurons.memory.plan import InfeasibleBudgetError
    from superneurons.memory.planner import decide

    def infeasible(*_args: Any, **_kwargs: Any) -> Any:
        raise InfeasibleBudgetError("injected: no plan fits", min_budget_bytes=7, strategy="auto")

    make_plan = decide.make_plan
    if rank == failing_rank:
        decide.make_plan = infeasible  # type: ignore[assignment]
    try:
        run_rank(rank, world_size, config)
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return type(exc).__name__, str(exc)
    finally:
        decide.make_plan = make_plan
    return "", ""


def load_checkpoint(out_dir: Path, rank: int) -> dict[str, Any]:
    return torch.load(checkpoint_path(out_dir, rank), weights_only=True)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rank_pid(launcher: subprocess.Popen[bytes], rank: int, deadline_s: float) -> int:
    """The pid of ``rank``'s process under a ``superneurons train`` launcher (waits for it)."""
    while time.monotonic() < deadline_s and launcher.poll() is None:
        for pid in descendants(launcher.pid):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if f"\0RANK={rank}\0".encode() in environ and b"superneurons.commands.rank" in cmdline:
                return pid
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} never started")
