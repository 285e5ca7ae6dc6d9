"""Honest records and crash-safe checkpoints across a resume (2 gloo ranks, tiny data).

- A run interrupted mid-epoch and resumed records what an uninterrupted run records: the same
  ``summary.json`` step count and each step once in ``metrics.jsonl``.
- A crash between writing a checkpoint's temporary file and renaming it, or a newest checkpoint
  cut short afterwards, leaves the previous complete checkpoint; ``--resume`` continues from it
  on every rank and ends bit for bit where the uninterrupted run ends. The slow test does it for
  real: SIGKILL to rank 1 (through the CLI and torchrun) while its checkpoint is being written.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from distributed import Ranks, shared_ranks
from superneurons.train.checkpoint import (
    checkpoint_path,
    find_resume_point,
    previous_checkpoint_path,
)
from superneurons.train.config import TrainConfig
from tiny_data import write_fashion_mnist
from train_support import rank_pid

pytestmark = pytest.mark.dist


class _Crash(Exception):
    """Stands in for a killed process at a chosen point."""


@pytest.fixture(scope="module")
def ranks() -> Ranks:
    return shared_ranks(2)


def _config(tmp_path: Path, name: str, **overrides: Any) -> TrainConfig:
    data = tmp_path / "data"
    if not data.exists():
        write_fashion_mnist(data, n_train=128, n_test=32)
    base: dict[str, Any] = {
        "model": "mlp",
        "data": "fashion-mnist",
        "data_dir": str(data),
        "out_dir": str(tmp_path / name),
        "batch_size": 16,
        "limit_steps": 3,
        "log_every": 2,
        "epochs": 3,
        "compress": "qsgd",
    }
    return TrainConfig(**{**base, **overrides})


def _train(rank: int, world_size: int, config: TrainConfig) -> dict[str, Any]:
    from superneurons.train.loop import run_training

    return run_training(config, torch.device("cpu"))


def _train_until_crash(rank: int, world_size: int, config: TrainConfig, at_step: int) -> str:
    """Train, but every rank 'dies' right after optimizer step ``at_step``."""
    from superneurons.train import metrics

    record = metrics.MetricsLog.record_step_time

    def record_then_crash(self: metrics.MetricsLog, **fields: Any) -> None:
        record(self, **fields)
        if self.steps == at_step:
            raise _Crash

    metrics.MetricsLog.record_step_time = record_then_crash  # type: ignore[method-assign]
    try:
        _train(rank, world_size, config)
    except _Crash:
        return "crashed"
    finally:
        metrics.MetricsLog.record_step_time = record  # type: ignore[method-assign]
    return "finished"


def _train_crash_in_save(rank: int, world_size: int, config: TrainConfig, at_step: int) -> str:
    """Train; rank 1 'dies' between writing its checkpoint of ``at_step`` to the temporary
    file and renaming it (rank 0 completes that save)."""
    from superneurons.train import checkpoint

    replace = checkpoint.os.replace

    def crash_before_rename(src: Any, dst: Any) -> None:
        is_new = rank == 1 and str(src).endswith(".tmp")
        if is_new and torch.load(src, weights_only=True, mmap=True)["step"] == at_step:
            raise _Crash
        replace(src, dst)

    checkpoint.os.replace = crash_before_rename  # type: ignore[assignment]
    try:
        _train(rank, world_size, config)
    except _Crash:
        return "crashed"
    finally:
        checkpoint.os.replace = replace  # type: ignore[assignment]
    return "finished"


def _straight_as_the_cli(ranks: Ranks, argv: list[str], out: Path) -> None:
    """The uninterrupted reference of a CLI run, on the shared ranks: ``superneurons train
    ARGV --out OUT``'s own parse (every CLI rank runs that config), without launching it."""
    from superneurons.cli import build_parser
    from superneurons.commands.train import config_from_args

    config = config_from_args(build_parser().parse_args([*argv, "--out", str(out)]))
    ranks.run(_train, config, timeout_s=180)


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def _assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _assert_same_checkpoints(a: Path, b: Path) -> None:
    for rank in range(2):
        x = torch.load(checkpoint_path(a, rank), weights_only=True)
        y = torch.load(checkpoint_path(b, rank), weights_only=True)
        assert (x["epoch"], x["step"]) == (y["epoch"], y["step"])
        for key in ("model", "optimizer", "compression", "rng"):
            _assert_same(x[key], y[key], f"rank{rank}.{key}")


@pytest.fixture(scope="module")
def straight(ranks: Ranks, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted reference run: 3 epochs of 3 steps."""
    root = tmp_path_factory.mktemp("resume")
    config = _config(root, "straight")
    ranks.run(_train, config, timeout_s=120)
    return Path(config.out_dir)


def test_interrupted_and_resumed_records_equal_uninterrupted(ranks: Ranks, straight: Path) -> None:
    root = straight.parent
    config = _config(root, "split")
    # Dies at step 5, in the second epoch: the checkpoint holds step 3, metrics.jsonl step 4.
    assert ranks.run(_train_until_crash, config, 5, timeout_s=120) == ["crashed"] * 2
    out = Path(config.out_dir)
    assert 4 in {r["step"] for r in _records(out) if r["kind"] == "step"}
    ranks.run(_train, _config(root, "split", resume=True), timeout_s=120)

    expected, got = _summary(straight), _summary(out)
    assert got["steps"] == expected["steps"] == 9
    assert set(got) == set(expected)
    for kind, key in (("step", "step"), ("epoch", "epoch")):
        want = [r[key] for r in _records(straight) if r["kind"] == kind]
        have = [r[key] for r in _records(out) if r["kind"] == kind]
        assert have == want, kind  # each once, in order
    _assert_same_checkpoints(straight, out)


def test_a_checkpoint_inside_an_epoch_resumes_bit_exact(ranks: Ranks, straight: Path) -> None:
    """--checkpoint-every 2: a run that dies at step 5 continues from step 4, one step into
    its second epoch (the batches before it skipped, the RNG as it was), and ends where the
    uninterrupted run ends, each step recorded once."""
    root = straight.parent
    config = _config(root, "mid-epoch", checkpoint_every=2)
    assert ranks.run(_train_until_crash, config, 5, timeout_s=120) == ["crashed"] * 2
    out = Path(config.out_dir)
    point = find_resume_point(out, config=asdict(config), world_size=2)
    assert (point.step, point.epoch) == (4, 1)
    assert torch.load(point.paths[0], weights_only=True)["epoch_step"] == 1
    ranks.run(_train, _config(root, "mid-epoch", checkpoint_every=2, resume=True), timeout_s=120)
    _assert_same_checkpoints(straight, out)
    assert _summary(out)["steps"] == _summary(straight)["steps"] == 9
    for kind, key in (("step", "step"), ("epoch", "epoch")):
        want = [r[key] for r in _records(straight) if r["kind"] == kind]
        assert [r[key] for r in _records(out) if r["kind"] == kind] == want, kind
    assert [(r["step"], r["restart"]) for r in _summary(out)["resumes"]] == [(4, 0)]


@pytest.mark.parametrize("damage", ["crash before rename", "newest file truncated"])
def test_resume_continues_from_the_last_complete_checkpoint(
    ranks: Ranks, straight: Path, damage: str
) -> None:
    root = straight.parent
    name = damage.replace(" ", "-")
    config = _config(root, name)
    out = Path(config.out_dir)
    if damage == "crash before rename":
        # The last save (step 9) completes on rank 0 only; rank 1 keeps its step-6 file.
        outcome = ranks.run(_train_crash_in_save, config, 9, timeout_s=120)
        assert outcome == ["finished", "crashed"]
        assert Path(f"{checkpoint_path(out, 1)}.tmp").exists()
    else:
        ranks.run(_train, config, timeout_s=120)
        newest = checkpoint_path(out, 1)
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 3])
    point = find_resume_point(out, config=asdict(config), world_size=2)
    assert point.step == 6 and point.epoch == 2
    assert point.paths[1] in (checkpoint_path(out, 1), previous_checkpoint_path(out, 1))
    ranks.run(_train, _config(root, name, resume=True), timeout_s=120)
    _assert_same_checkpoints(straight, out)
    assert _summary(out)["steps"] == _summary(straight)["steps"]


def test_a_fresh_run_removes_an_earlier_runs_checkpoint(ranks: Ranks, straight: Path) -> None:
    root = straight.parent
    config = _config(root, "again", epochs=1)
    ranks.run(_train, config, timeout_s=120)
    out = Path(config.out_dir)
    stale = previous_checkpoint_path(out, 0)
    stale.write_bytes(checkpoint_path(straight, 0).read_bytes())  # a later run's file
    ranks.run(_train, config, timeout_s=120)
    assert not stale.exists()
    assert [r["step"] for r in _records(out) if r["kind"] == "step"] == [2, 3]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_sigkill_during_a_checkpoint_write_then_resume_is_bit_exact(
    ranks: Ranks, tmp_path: Path
) -> None:
    """The real thing, through the CLI and torchrun: SIGKILL rank 1 while its checkpoint's
    temporary file is being written, then ``--resume``; it ends where the uninterrupted run
    (the same arguments, :func:`_straight_as_the_cli`) ends."""
    data = write_fashion_mnist(tmp_path / "data", n_train=256, n_test=32)
    argv = ["train", "--model", "mlp", "--data", "fashion-mnist", "--data-dir", str(data)]
    argv += ["--batch-size", "16", "--nproc", "2", "--epochs", "4", "--compress", "qsgd"]
    command = [sys.executable, "-m", "superneurons.cli", *argv]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    straight, out = tmp_path / "straight", tmp_path / "killed"
    _straight_as_the_cli(ranks, argv, straight)

    launcher = subprocess.Popen(
        [*command, "--out", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline_s = time.monotonic() + 300
        pid = rank_pid(launcher, 1, deadline_s)
        newest = checkpoint_path(out, 1)
        tmp = Path(f"{newest}.tmp")
        while not (newest.exists() and tmp.exists()):  # a later save of rank 1 under way
            assert launcher.poll() is None and time.monotonic() < deadline_s, "missed the save"
            time.sleep(0.0005)
        os.kill(pid, signal.SIGKILL)
        assert launcher.wait(timeout=300) != 0
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    resumed = subprocess.run(
        [*command, "--out", str(out), "--resume"], env=env, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    _assert_same_checkpoints(straight, out)
    assert _summary(out)["steps"] == _summary(straight)["steps"]
    have = [r["step"] for r in _records(out) if r["kind"] == "step"]
    assert have == [r["step"] for r in _records(straight) if r["kind"] == "step"]


def kill_one_rank_and_check(
    ranks: Ranks, tmp_path: Path, *, rank: int, at_step: int, compress: str = "qsgd"
) -> dict[str, Any]:
    """``superneurons train --max-restarts 3 --checkpoint-every 3`` on 2 ranks (16 steps);
    SIGKILL ``rank`` once ``metrics.jsonl`` shows step ``at_step``. The run must finish by
    itself, end bit for bit where an uninterrupted run of the same arguments ends
    (:func:`_straight_as_the_cli`), count each step once and redo at most 3 steps. Returns
    the resume record."""
    from superneurons.train.metrics import last_logged_step

    data = tmp_path / "data"
    if not data.exists():
        write_fashion_mnist(data, n_train=256, n_test=32)
    argv = ["train", "--model", "mlp", "--data", "fashion-mnist", "--data-dir", str(data)]
    # the peer of a killed rank must not complete the step: its failed collective raises
    # through the hook's callbacks (superneurons.ddp.callbacks), as PyTorch's all-reduce does
    argv += ["--batch-size", "16", "--nproc", "2", "--epochs", "2", "--compress", compress]
    argv += ["--log-every", "1"]
    command = [sys.executable, "-m", "superneurons.cli", *argv]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    straight = tmp_path / f"straight-{compress}"
    if not (straight / "summary.json").exists():  # uninterrupted, no mid-epoch checkpoints
        _straight_as_the_cli(ranks, argv, straight)
    out = tmp_path / f"killed-{compress}-rank{rank}-step{at_step}"
    elastic = ["--max-restarts", "3", "--checkpoint-every", "3", "--out", str(out)]
    with (tmp_path / f"{out.name}.log").open("wb") as log:
        launcher = subprocess.Popen(
            [*command, *elastic], env=env, stdout=log, stderr=log, start_new_session=True
        )
        try:
            deadline_s = time.monotonic() + 300
            pid = rank_pid(launcher, rank, deadline_s)
            while (last_logged_step(out / "metrics.jsonl") or 0) < at_step:
                assert launcher.poll() is None, f"finished before step {at_step}"
                assert time.monotonic() < deadline_s, f"step {at_step} never came"
                time.sleep(0.005)
            os.kill(pid, signal.SIGKILL)
            status = launcher.wait(timeout=600)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
    where = f"rank {rank} killed at step {at_step}; log {tmp_path / f'{out.name}.log'}"
    assert status == 0, where
    summary = _summary(out)
    assert summary["steps"] == _summary(straight)["steps"] == 16, where
    assert [r["step"] for r in _records(out) if r["kind"] == "step"] == list(range(1, 17)), where
    assert [r["epoch"] for r in _records(out) if r["kind"] == "epoch"] == [0, 1], where
    _assert_same_checkpoints(straight, out)
    assert summary["restarts"] == 1, where
    (resume,) = summary["resumes"]
    assert resume["restart"] == 1, where
    redone = resume["last_logged_step"] - resume["step"]
    assert resume["last_logged_step"] >= at_step and 0 <= redone <= 3, (where, resume)
    return dict(resume)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_a_killed_rank_is_restarted_and_the_run_ends_bit_exact(
    ranks: Ranks, tmp_path: Path
) -> None:
    """A lost rank needs nobody: torchrun restarts the workers, they resume from the newest
    common checkpoint (at most --checkpoint-every steps back), the model ends bit for bit."""
    chooser = random.Random()
    rank, at_step = chooser.randrange(2), chooser.randrange(1, 16)
    kill_one_rank_and_check(ranks, tmp_path, rank=rank, at_step=at_step)
