"""Bad input to ``superneurons train`` is caught in the launcher, before any rank starts: exit
status 2, one line naming the file or flag and what to do, no traceback, within seconds.

Each case runs ``main()`` in-process (its CPU time is the check's cost; imports are already
paid); :func:`test_bad_input_through_a_fresh_interpreter` runs two of them as a user does,
through ``python -m superneurons.cli``, where start-up counts too.
"""

from __future__ import annotations

import gzip
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from superneurons.cli import main
from superneurons.models import build_model
from superneurons.train.checkpoint import checkpoint_path, save_checkpoint
from superneurons.train.precheck import resident_bytes
from tiny_data import write_fashion_mnist

# The target: every bad input answered in at most this many seconds.
BOUND_S = 5.0
SRC = Path(__file__).resolve().parents[1] / "src"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _truncated_gz(data: Path, out: Path) -> tuple[list[str], str]:
    _truncate(data / "t10k-images-idx3-ubyte.gz")
    return [], "t10k-images-idx3-ubyte.gz"


def _truncated_raw(data: Path, out: Path) -> tuple[list[str], str]:
    gz = data / "train-labels-idx1-ubyte.gz"
    raw = data / "train-labels-idx1-ubyte"
    raw.write_bytes(gzip.decompress(gz.read_bytes())[:-7])
    gz.unlink()
    return [], "train-labels-idx1-ubyte"


def _checkpoint(out: Path) -> Path:
    model = build_model("mlp")
    return save_checkpoint(
        out,
        0,
        epoch=1,
        step=3,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        compression={},
        config={},
        world_size=1,
    )


def _truncated_checkpoint(data: Path, out: Path) -> tuple[list[str], str]:
    _truncate(_checkpoint(out))
    return ["--resume"], "rank0.pt"


def _garbage_checkpoint(data: Path, out: Path) -> tuple[list[str], str]:
    path = checkpoint_path(out, 0)
    path.parent.mkdir(parents=True)
    path.write_bytes(bytes(range(256)) * 64)
    return ["--resume"], "rank0.pt"


def _checkpoint_of_one_rank(data: Path, out: Path) -> tuple[list[str], str]:
    _checkpoint(out)
    return ["--resume", "--nproc", "2"], "resume with --nproc 1"


def _flags(flags: list[str], names: str) -> Callable[[Path, Path], tuple[list[str], str]]:
    return lambda data, out: (flags, names)


def _budget_below_any_plan(data: Path, out: Path) -> tuple[list[str], str]:
    # Above the parameters + gradients floor, below what any plan needs (activations too):
    # caught by the launcher's fake-tensor profile, not by a rank.
    floor_bytes = resident_bytes(build_model("mlp"))
    return ["--budget", str(floor_bytes + 1024)], "smallest predicted peak"


CASES: dict[str, Callable[[Path, Path], tuple[list[str], str]]] = {
    "truncated .gz IDX": _truncated_gz,
    "truncated raw IDX": _truncated_raw,
    "truncated checkpoint": _truncated_checkpoint,
    "garbage checkpoint": _garbage_checkpoint,
    "checkpoint of another world size": _checkpoint_of_one_rank,
    "budget 1KiB": _flags(["--budget", "1KiB"], "--budget"),
    "budget below any plan": _budget_below_any_plan,
    "budget abc": _flags(["--budget", "abc"], "'abc'"),
    "theta 1.0": _flags(["--compress", "fft:theta=1.0"], "theta=1.0"),
    "theta -0.1": _flags(["--compress", "fft:theta=-0.1"], "theta=-0.1"),
    "unknown codec": _flags(["--compress", "zstd"], "'zstd'"),
    "unknown model": _flags(["--model", "transformer-xl"], "--model transformer-xl"),
    "nproc 0": _flags(["--nproc", "0"], "--nproc"),
    "fewer samples than ranks": _flags(["--nproc", "200"], "fewer than the 200 ranks"),
    "missing data dir": _flags(["--data-dir", "/nonexistent/fmnist"], "/nonexistent/fmnist"),
    "resume without checkpoint": _flags(["--resume"], "--resume"),
}


def _command(data: Path, out: Path, extra: list[str]) -> list[str]:
    base = ["train", "--model", "mlp", "--data", "fashion-mnist", "--data-dir", str(data)]
    return [*base, "--out", str(out), "--limit-steps", "1", *extra]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    data, out = write_fashion_mnist(tmp_path / "data"), tmp_path / "out"
    extra, named = CASES[case](data, out)
    capsys.readouterr()
    start_s = time.process_time()
    status = main(_command(data, out, extra))
    cpu_s = time.process_time() - start_s
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("superneurons: error: ") and named in err, err
    assert "Traceback" not in err
    assert cpu_s <= BOUND_S, f"{case}: {cpu_s:.1f} s of CPU"


def _child_cpu_s(command: list[str], env: dict[str, str]) -> tuple[float, Any]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done


def test_bad_input_through_a_fresh_interpreter(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    # NOTE: start-up (the interpreter, torch's import) is measured beside the check, in the same
    # test, so a busy machine raises both: the bound is on the work the refusal adds to it.
    start_up_s, _ = _child_cpu_s([sys.executable, "-m", "superneurons.cli", "--help"], env)
    for case in ("truncated .gz IDX", "garbage checkpoint"):
        data = write_fashion_mnist(tmp_path / case / "data")
        out = tmp_path / case / "out"
        extra, named = CASES[case](data, out)
        command = [sys.executable, "-m", "superneurons.cli", *_command(data, out, extra)]
        cpu_s, done = _child_cpu_s(command, env)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and named in lines[0] and "Traceback" not in done.stderr, lines
        assert cpu_s - start_up_s <= BOUND_S, (
            f"{case}: {cpu_s:.1f} s of CPU, {start_up_s:.1f} s of it the interpreter's start-up"
        )
