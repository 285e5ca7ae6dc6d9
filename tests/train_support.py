"""Shared by the ``superneurons train`` tests: the small MLP run on Fashion-MNIST, one rank's
training (run in spawned ranks) and reading a rank's checkpoint back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

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


def load_checkpoint(out_dir: Path, rank: int) -> dict[str, Any]:
    return torch.load(checkpoint_path(out_dir, rank), weights_only=False)
