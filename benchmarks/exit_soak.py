"""Clean exits and lost ranks, counted over many real runs (2 gloo ranks through torchrun).

Three modes, each writing OUT/<mode>.json (every run: exit status, aborts, seconds, load) and
OUT/<mode>.md (the counts):

- ``ddp-example``: ``torchrun --nproc-per-node 2 examples/ddp_compression.py --steps 5``;
  an abort is a ``terminate called`` line in stderr or a SIGABRT exit (gloo's worker threads at
  teardown, pytorch#179291). Target: 0 aborts, 0 non-zero exits.
- ``train``: ``superneurons train --nproc 2`` for 1 short epoch of the MLP (Fashion-MNIST,
  ``--limit-steps 8``, fft codec). Target: 0 aborts, 0 non-zero exits.
- ``kill``: ``superneurons train --nproc 2 --max-restarts 3 --checkpoint-every 3`` (2 epochs
  of 8 steps; ``--compress`` qsgd by default, or e.g. dense), SIGKILL to a random rank at a
  random step; the run must end by itself with status 0, its checkpoints bit for bit those of
  an uninterrupted run, every step once in ``metrics.jsonl`` and ``summary.json``, at most 3
  steps redone.

``--burner`` runs ``yes > /dev/null`` beside the ranks for the whole soak (killed at the end);
``--until HH:MM`` (UTC) stops starting runs at that time, so a soak fits a window. Run it
niced on a shared machine::

    nice -n 10 .venv/bin/python benchmarks/exit_soak.py ddp-example --count 200 --burner \\
        --logs /tmp/soak --out benchmarks/results/clean_exits
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from superneurons.bench.artifacts import markdown_table, write_json, write_markdown

ROOT = Path(__file__).resolve().parents[1]
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


def _load() -> str:
    return "/".join(f"{v:.2f}" for v in os.getloadavg())


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")


def _aborted(returncode: int, stderr: str) -> bool:
    return "terminate called" in stderr or returncode in (-signal.SIGABRT, 128 + signal.SIGABRT)


def _torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run"]


def ddp_example(index: int, logs: Path, _: argparse.Namespace) -> dict[str, Any]:
    command = [*_torchrun(), "--nproc-per-node", "2", "--master-port", str(29600 + index % 300)]
    command += ["--log-dir", str(logs / f"torchrun{index}")]  # not a torchelastic_* in /tmp
    command += [str(ROOT / "examples" / "ddp_compression.py"), "--steps", "5"]
    return _run(index, command, logs)


def _train_command(data: Path) -> list[str]:
    command = [sys.executable, "-m", "superneurons.cli", "train", "--model", "mlp"]
    return command + ["--data", "fashion-mnist", "--data-dir", str(data), "--batch-size", "16"]


def train(index: int, logs: Path, args: argparse.Namespace) -> dict[str, Any]:
    command = [*_train_command(args.data_dir), "--nproc", "2", "--epochs", "1"]
    command += ["--limit-steps", "8", "--compress", "fft:theta=0.9,bits=8"]
    return _run(index, [*command, "--out", str(logs / f"run{index}")], logs)


def _run(index: int, command: list[str], logs: Path) -> dict[str, Any]:
    start = time.monotonic()
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600)
    (logs / f"run{index}.out").write_text(done.stdout)
    (logs / f"run{index}.err").write_text(done.stderr)
    return {
        "run": index,
        "returncode": done.returncode,
        "aborted": _aborted(done.returncode, done.stderr),
        "terminate_called": done.stderr.count("terminate called"),
        "seconds": round(time.monotonic() - start, 1),
        "load": _load(),
    }


def kill(index: int, logs: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One random kill; the checks are the slow test's (tests/test_resume_records.py)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_resume_records import kill_one_rank_and_check
    from tiny_data import write_fashion_mnist

    chooser = random.Random(args.seed * 1000 + index)
    rank, at_step = chooser.randrange(2), chooser.randrange(1, 16)
    start = time.monotonic()
    record: dict[str, Any] = {"run": index, "compress": args.compress, "rank": rank}
    record["killed_at_step"] = at_step
    here = logs / f"run{index}"  # its own directory; the data and the reference run shared
    here.mkdir(parents=True, exist_ok=True)
    if not (logs / "data").exists():
        write_fashion_mnist(logs / "data", n_train=256, n_test=32)
    for shared in ("data", f"straight-{args.compress}"):
        (logs / shared).mkdir(exist_ok=True)
        if not (here / shared).exists():
            (here / shared).symlink_to(logs / shared)
    try:
        resume = kill_one_rank_and_check(here, rank=rank, at_step=at_step, compress=args.compress)
    except (AssertionError, subprocess.SubprocessError) as exc:
        record.update(passed=False, failure=repr(exc)[:400])
    else:
        redone = resume["last_logged_step"] - resume["step"]
        record.update(passed=True, resumed_from_step=resume["step"], steps_redone=redone)
    record.update(seconds=round(time.monotonic() - start, 1), load=_load())
    return record


MODES: dict[str, Callable[[int, Path, argparse.Namespace], dict[str, Any]]] = {
    "ddp-example": ddp_example,
    "train": train,
    "kill": kill,
}


def _summary(mode: str, records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {"mode": mode, "runs": len(records), "burner": args.burner}
    if mode == "kill":
        summary["passed"] = sum(r["passed"] for r in records)
        summary["failed"] = len(records) - summary["passed"]
        summary["max_steps_redone"] = max((r.get("steps_redone", 0) for r in records), default=0)
        summary["checkpoint_every"] = 3
    else:
        summary["nonzero_exits"] = sum(r["returncode"] != 0 for r in records)
        summary["aborts"] = sum(r["aborted"] for r in records)
        summary["runs_with_terminate_called"] = sum(r["terminate_called"] > 0 for r in records)
    seconds = [r["seconds"] for r in records]
    summary["seconds_median"] = sorted(seconds)[len(seconds) // 2] if seconds else None
    summary["load_first_last"] = [records[0]["load"], records[-1]["load"]] if records else None
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=sorted(MODES))
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--until", default=None, help="UTC HH:MM: start no run after it")
    parser.add_argument("--burner", action="store_true", help="a busy loop beside the ranks")
    parser.add_argument("--seed", type=int, default=0, help="kill: the random ranks and steps")
    parser.add_argument("--data-dir", type=Path, default=FASHION_MNIST)
    parser.add_argument("--compress", default="qsgd", help="kill: the gradient route")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/exit_soak"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/clean_exits"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    deadline = None
    if args.until:
        now = dt.datetime.now(dt.UTC)
        hour, minute = (int(v) for v in args.until.split(":"))
        deadline = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
    logs = args.logs / args.mode
    logs.mkdir(parents=True, exist_ok=True)
    burner = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) if args.burner else None
    records: list[dict[str, Any]] = []
    try:
        for index in range(1, args.count + 1):
            if deadline is not None and dt.datetime.now(dt.UTC) >= deadline:
                break
            records.append(MODES[args.mode](index, logs, args))
            with (logs / "records.jsonl").open("a") as handle:
                handle.write(json.dumps(records[-1]) + "\n")
            _write(args, records)
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    _write(args, records)
    return 0


def _write(args: argparse.Namespace, records: list[dict[str, Any]]) -> None:
    summary = _summary(args.mode, records, args)
    write_json(args.out / f"{args.mode}.json", records, summary=summary, runs_asked=args.count)
    columns = [k for k in summary if k not in ("mode", "load_first_last")]
    body = markdown_table([summary], columns)
    body += f"\nRuns asked: {args.count}; run: {len(records)}. Load (1/5/15 min) at the first and "
    body += f"last run: {summary['load_first_last']}. Logs: {args.logs / args.mode}.\n"
    write_markdown(args.out / f"{args.mode}.md", f"Exit soak: {args.mode}", body)


if __name__ == "__main__":
    sys.exit(main())
