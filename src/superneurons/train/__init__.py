"""Data-parallel training with compressed gradients: the engine of ``superneurons train``.

``train(config)`` runs one rank (inside torchrun); :mod:`.launch` starts the ranks;
:mod:`.checkpoint` saves and resumes bit for bit; :mod:`.metrics` writes metrics.jsonl and
summary.json; :mod:`.task` maps (model, data) to builders.
"""

from __future__ import annotations

from superneurons.train.config import TrainConfig

__all__ = ["TrainConfig", "train"]


def train(config: TrainConfig) -> dict[str, object]:
    """Run ``config`` on this rank; see :func:`superneurons.train.loop.train`."""
    from superneurons.train.loop import train as _train

    return _train(config)
