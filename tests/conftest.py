"""Shared test configuration: CPU-first, deterministic, one thread per process."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if "netns" in item.keywords:
            # NOTE: one worker under pytest-xdist (--dist loadgroup): creating namespaces
            # removes every stale one first, which races a test that plants a stale one
            item.add_marker(pytest.mark.xdist_group("netns"))
    # NOTE: slow tests first (a stable sort: file order otherwise). Under pytest-xdist the
    # workers then end together, instead of one running a two-minute test alone at the end
    # (longest first). Their module fixtures are shared_ranks(), one group per process.
    items.sort(key=lambda item: "slow" not in item.keywords)


def pytest_configure(config: pytest.Config) -> None:
    # One thread per process: on a 2-core machine torch's default threads made small ops
    # 30-50x slower when another process (a gloo rank) was busy.
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps one state per process: a trainer built with ``bf16=True`` (TRL's
    default) leaves it in bf16, and a later ``Accelerator(cpu=True)`` in the same worker would
    silently train in bf16 too. Each test starts from none."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


class TwoRankRuns:
    """The records of tests/two_rank_runs.py's parts, launched once under torchrun."""

    def __init__(self, out: Path, result: subprocess.CompletedProcess[str]) -> None:
        self.out = out
        self.result = result

    def part(self, name: str) -> list[dict[str, Any]]:
        """Part ``name``'s records by rank; fails with the launch's output where it has none."""
        files = [self.out / name / f"rank{r}.json" for r in (0, 1)]
        missing = [str(f) for f in files if not f.exists()]
        assert not missing, (
            f"tests/two_rank_runs.py (rc {self.result.returncode}) wrote no {missing}:\n"
            f"{self.result.stderr[-3000:]}"
        )
        return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="session")
def two_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> TwoRankRuns:
    """One torchrun launch of tests/two_rank_runs.py for every test that reads its parts.
    Those tests share ``xdist_group("two-rank-runs")``: one worker, one launch."""
    from integrations_support import torchrun

    out = tmp_path_factory.mktemp("two-rank-runs")
    return TwoRankRuns(out, torchrun("tests/two_rank_runs.py", out, timeout_s=1500))
