"""Shared test configuration: CPU-first, deterministic, one thread per process."""

from __future__ import annotations

import sys
from collections.abc import Iterator

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
