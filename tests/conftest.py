"""Shared test configuration: CPU-first, deterministic, one thread per process."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
