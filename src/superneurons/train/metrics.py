"""What a training run records: ``OUT/metrics.jsonl`` (one JSON object per line) and
``OUT/summary.json``.

Step records (every ``log_every`` steps): ``kind="step"``, ``step``, ``epoch``, ``loss`` and
``accuracy`` on rank 0's batch, ``bytes_sent`` (the payload this rank put on the wire in that
step, see :class:`~superneurons.compress.hookstate.CompressionState`), ``step_s`` (forward,
backward with communication, optimizer). Epoch records: ``kind="epoch"``, ``epoch``,
``test_loss``, ``test_accuracy`` (all ranks' shards of the test split), ``wall_s``.
Only rank 0 writes; a resumed run appends.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from types import TracebackType
from typing import IO, Any

__all__ = ["MetricsLog", "summarize", "write_summary"]


class MetricsLog:
    """Appends JSON lines to ``OUT/metrics.jsonl`` on rank 0; a no-op elsewhere."""

    def __init__(self, out_dir: str | Path, *, enabled: bool) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        self.step_s: list[float] = []
        self.bytes_sent: list[int] = []
        self.dense_bytes: list[int] = []
        self._file: IO[str] | None = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")

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

    def record_step_time(self, *, step_s: float, bytes_sent: int, dense_bytes: int) -> None:
        """Every step, logged or not, feeds the summary."""
        self.step_s.append(step_s)
        self.bytes_sent.append(bytes_sent)
        self.dense_bytes.append(dense_bytes)

    def write(self, kind: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"kind": kind, **fields}) + "\n")
            self._file.flush()


def summarize(log: MetricsLog, **fields: Any) -> dict[str, Any]:
    """Summary of a run: ``mean_step_s`` leaves out the first step (allocation, DDP's bucket
    rebuild), ``bytes_per_step`` is the mean payload per step."""
    steady = log.step_s[1:] or log.step_s
    return {
        **fields,
        "steps": len(log.step_s),
        "mean_step_s": statistics.fmean(steady) if steady else None,
        "bytes_per_step": statistics.fmean(log.bytes_sent) if log.bytes_sent else None,
        "dense_bytes_per_step": statistics.fmean(log.dense_bytes) if log.dense_bytes else None,
    }


def write_summary(out_dir: str | Path, summary: dict[str, Any]) -> Path:
    path = Path(out_dir) / "summary.json"
    path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path
