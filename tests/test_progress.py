"""Progress suits its output: plain lines (never carriage returns) where stderr is not a
terminal, a live tqdm bar where it is; and the records a resume rewrites."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from superneurons.train.metrics import MetricsLog, keep_records_until, summarize
from superneurons.train.progress import LineProgress, progress_bar


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_every_interval_and_at_close_without_carriage_returns() -> None:
    stream, clock = io.StringIO(), _Clock()
    progress = LineProgress(100, desc="epoch 1/2", file=stream, unit="step", clock=clock)
    for _ in range(100):
        clock.now_s += 0.25  # 4 steps/s: a line every 10 s is every 40 steps
        progress.update(1)
        progress.set_postfix(loss="0.500")
    progress.close()
    progress.close()  # closing twice writes nothing more
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines == [
        "epoch 1/2: 40/100 step (40%), 4 step/s, loss=0.500",
        "epoch 1/2: 80/100 step (80%), 4 step/s, loss=0.500",
        "epoch 1/2: 100/100 step (100%), 4 step/s, loss=0.500",
    ]


def test_progress_bar_picks_lines_off_a_terminal_and_tqdm_on_one() -> None:
    log = io.StringIO()
    with progress_bar(10, desc="capture", file=log) as bar:
        assert isinstance(bar, LineProgress)
        bar.update(10)
    assert log.getvalue().count("\n") == 1 and "\r" not in log.getvalue()
    tqdm = pytest.importorskip("tqdm").tqdm

    terminal = _Terminal()
    with progress_bar(10, desc="capture", file=terminal) as bar:
        assert isinstance(bar, tqdm)
        bar.update(10)
    assert "\r" in terminal.getvalue()  # a live bar redraws in place


def _rows(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resume_drops_rows_after_the_checkpoint_and_a_partial_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"kind": "step", "step": s, "epoch": (s - 1) // 3} for s in range(1, 6)]
    rows.insert(3, {"kind": "epoch", "epoch": 0, "step": 3})
    text = "".join(json.dumps(row) + "\n" for row in rows) + '{"kind": "st'
    path.write_text(text)
    assert keep_records_until(path, epochs_done=1, steps_done=3) == 3
    assert _rows(path) == rows[:4]
    assert keep_records_until(path, epochs_done=1, steps_done=3) == 0  # idempotent


def test_metrics_state_carries_every_step_across_a_resume(tmp_path: Path) -> None:
    first = MetricsLog(tmp_path, enabled=True)
    for i in range(3):
        first.record_step_time(step_s=1.0 + i, bytes_sent=10, dense_bytes=40)
        first.write("step", step=i + 1)
    state = first.state_dict()
    first.close()
    with MetricsLog(tmp_path, enabled=True, resume_at=(0, 2)) as second:
        second.load_state_dict(state)
        second.record_step_time(step_s=9.0, bytes_sent=20, dense_bytes=40)
        summary = summarize(second)
    assert summary["steps"] == 4
    # Each process's first step (allocation) is left out of the mean: 2.0, 3.0 remain.
    assert summary["mean_step_s"] == 2.5
    assert summary["bytes_per_step"] == 12.5
    assert [row["step"] for row in _rows(tmp_path / "metrics.jsonl")] == [1, 2]
    with MetricsLog(tmp_path, enabled=True):  # a run without resume starts over
        pass
    assert (tmp_path / "metrics.jsonl").read_text() == ""
