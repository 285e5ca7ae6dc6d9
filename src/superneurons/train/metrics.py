"""What a training run records: ``OUT/metrics.jsonl`` (one JSON object per line) and
``OUT/summary.json``.

Step records (every ``log_every`` steps): ``kind="step"``, ``step``, ``epoch``, ``loss`` and
``accuracy`` on rank 0's batch, ``bytes_sent`` (the payload this rank put on the wire in that
step, see :class:`~superneurons.ddp.state.CompressionState`), ``step_s`` (forward,
backward with communication, optimizer). Epoch records: ``kind="epoch"``, ``epoch``, ``step``
(steps completed), ``test_loss``, ``test_accuracy`` (all ranks' shards of the test split),
``wall_s``. With a clock (``time_budget_s`` / ``eval_every_s``): eval records, ``kind="eval"``,
``step``, ``train_s`` (seconds of training so far, evaluations left out), ``wall_s``,
``test_loss``, ``test_accuracy``. Only rank 0 writes.

The records are honest across a resume: the checkpoint carries :meth:`MetricsLog.state_dict`
(every step's time and bytes so far, the wall time so far), and a resumed run first drops the
rows written after the checkpoint's step (atomically), so ``metrics.jsonl`` holds each step once
and ``summary.json`` counts every step of the run, as an uninterrupted run would. The summary
also lists each resume the run went through (``resumes``: the elastic restart it came from, the
step it continued from, and the last step ``metrics.jsonl`` held before it: with
``--log-every 1`` their difference is the work recomputed) and ``restarts``, how many times
torchrun restarted the workers.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

__all__ = ["MetricsLog", "keep_records_until", "last_logged_step", "summarize", "write_summary"]

METRICS_STATE_VERSION = 1


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _before(row: dict[str, Any], *, epochs_done: int, steps_done: int) -> bool:
    """Was ``row`` written before a checkpoint of ``epochs_done`` epochs, ``steps_done`` steps?"""
    if row.get("kind") == "epoch":
        return int(row.get("epoch", 0)) < epochs_done
    return int(row.get("step", 0)) <= steps_done


def last_logged_step(path: str | Path) -> int | None:
    """The highest ``step`` of the step rows in ``path`` (None: no file or no step row)."""
    path = Path(path)
    if not path.exists():
        return None
    steps = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("kind") == "step":
            steps.append(int(row.get("step", 0)))
    return max(steps, default=None)


def keep_records_until(path: str | Path, *, epochs_done: int, steps_done: int) -> int:
    """Rewrite ``path`` (atomically) without the rows written after a checkpoint that had
    completed ``epochs_done`` epochs and ``steps_done`` steps; returns how many rows it dropped.

    Step rows are kept up to ``steps_done``, epoch rows below ``epochs_done``; a partial last
    line (a writer killed mid-line) is dropped too.
    """
    path = Path(path)
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if isinstance(row, dict) and _before(row, epochs_done=epochs_done, steps_done=steps_done):
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        _write_atomically(path, "".join(f"{line}\n" for line in kept))
    return dropped


class MetricsLog:
    """Writes JSON lines to ``OUT/metrics.jsonl`` on rank 0 (a no-op elsewhere) and keeps every
    step's time and bytes for the summary.

    ``resume_at=(epochs_done, steps_done)`` continues a run: rows after that point are dropped
    and new ones appended; call :meth:`load_state_dict` with the checkpoint's state. Without it
    the run starts over and the file is truncated.
    """

    def __init__(
        self, out_dir: str | Path, *, enabled: bool, resume_at: tuple[int, int] | None = None
    ) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        self.steps = 0  # every step of the run, including those before a resume
        self.step_s: list[float] = []
        self.bytes_sent: list[int] = []
        self.dense_bytes: list[int] = []
        self.cold_steps: list[int] = []  # indices of each process's first step (allocation)
        self._wall_before_s = 0.0
        self.eval_s = 0.0  # seconds spent evaluating (left out of train_s)
        self.last_eval_train_s: float | None = None  # train_s at the last evaluation
        self._start_s = time.perf_counter()
        self._new_process = True
        self.resumes: list[dict[str, Any]] = []  # every resume on the way to this point
        self._file: IO[str] | None = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_at is not None:
                epochs_done, steps_done = resume_at
                keep_records_until(self.path, epochs_done=epochs_done, steps_done=steps_done)
            self._file = self.path.open("a" if resume_at is not None else "w", encoding="utf-8")

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    @property
    def wall_s(self) -> float:
        """Seconds of this run so far, the time before a resume included."""
        return self._wall_before_s + time.perf_counter() - self._start_s

    @property
    def train_s(self) -> float:
        """Seconds of training so far: :attr:`wall_s` less the evaluations."""
        return self.wall_s - self.eval_s

    def record_step_time(self, *, step_s: float, bytes_sent: int, dense_bytes: int) -> None:
        """Every step, logged or not, feeds the summary."""
        if self._new_process:
            self.cold_steps.append(len(self.step_s))
            self._new_process = False
        self.steps += 1
        self.step_s.append(step_s)
        self.bytes_sent.append(bytes_sent)
        self.dense_bytes.append(dense_bytes)

    def note_resume(self, *, step: int, restart: int, last_logged_step: int | None) -> None:
        """This process continues the run from a checkpoint of ``step`` (0: from the start)
        after torchrun's ``restart``-th restart of the workers (0: a ``--resume`` by hand);
        ``last_logged_step``: the newest step row ``metrics.jsonl`` held before (None on ranks
        that do not write it). Call after :meth:`load_state_dict`."""
        self.resumes.append(
            {"restart": restart, "step": step, "last_logged_step": last_logged_step}
        )

    def write(self, kind: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"kind": kind, **fields}) + "\n")
            self._file.flush()

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": METRICS_STATE_VERSION,
            "steps": self.steps,
            "step_s": list(self.step_s),
            "bytes_sent": list(self.bytes_sent),
            "dense_bytes": list(self.dense_bytes),
            "cold_steps": list(self.cold_steps),
            "wall_s": self.wall_s,
            "eval_s": self.eval_s,
            "last_eval_train_s": self.last_eval_train_s,
            "resumes": [dict(r) for r in self.resumes],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the records of ``state``; a state with only ``steps`` (a checkpoint from
        before these records) still counts those steps."""
        self.step_s = [float(s) for s in state.get("step_s", [])]
        self.bytes_sent = [int(b) for b in state.get("bytes_sent", [])]
        self.dense_bytes = [int(b) for b in state.get("dense_bytes", [])]
        self.cold_steps = [int(i) for i in state.get("cold_steps", [])]
        self.steps = int(state.get("steps", len(self.step_s)))
        self.resumes = [dict(r) for r in state.get("resumes", [])]
        self._wall_before_s = float(state.get("wall_s", 0.0))
        self.eval_s = float(state.get("eval_s", 0.0))
        last = state.get("last_eval_train_s")
        self.last_eval_train_s = None if last is None else float(last)
        self._start_s = time.perf_counter()
        self._new_process = True


def summarize(log: MetricsLog, **fields: Any) -> dict[str, Any]:
    """Summary of a run: ``steps`` counts every step (a resumed run's included),
    ``mean_step_s`` leaves out each process's first step (allocation, DDP's bucket rebuild),
    ``bytes_per_step`` is the mean payload per step."""
    cold = set(log.cold_steps)
    steady = [s for i, s in enumerate(log.step_s) if i not in cold] or log.step_s
    return {
        **fields,
        "steps": log.steps,
        "resumes": [dict(r) for r in log.resumes],
        "mean_step_s": statistics.fmean(steady) if steady else None,
        "bytes_per_step": statistics.fmean(log.bytes_sent) if log.bytes_sent else None,
        "dense_bytes_per_step": statistics.fmean(log.dense_bytes) if log.dense_bytes else None,
    }


def write_summary(out_dir: str | Path, summary: dict[str, Any]) -> Path:
    path = Path(out_dir) / "summary.json"
    _write_atomically(path, json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return path
