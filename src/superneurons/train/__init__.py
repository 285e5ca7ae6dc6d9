"""Data-parallel training with compressed gradients: the engine of ``superneurons train``.

``train(config)`` runs one rank (inside torchrun); :mod:`.launch` starts the ranks;
:mod:`.checkpoint` saves and resumes bit for bit; :mod:`.metrics` writes metrics.jsonl and
summary.json; :mod:`.task` maps (model, data) to builders. Your own distributed script joins
the group torchrun prepared with :func:`init_distributed` and ends with :func:`exit_rank`
(:mod:`.rank` says why not ``destroy_process_group``).
"""

from __future__ import annotations

from superneurons.train.config import TrainConfig
from superneurons.train.rank import exit_rank, init_distributed

__all__ = ["TrainConfig", "exit_rank", "init_distributed", "train"]


def train(config: TrainConfig) -> dict[str, object]:
    """Run ``config`` on this rank; see :func:`superneurons.train.loop.train`."""
    from superneurons.train.loop import train as _train

    return _train(config)
