"""Per-rank training checkpoints that resume bit for bit.

Each rank writes ``OUT/checkpoint/rank{r}.pt``: the model and optimizer (identical on every
rank), plus what is *not* identical across ranks — the compression state (error-feedback
residuals are local) and the RNG streams (dropout). Files are written to a temporary name and
renamed, so a crash mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from superneurons.errors import ConfigError

__all__ = ["Checkpoint", "checkpoint_path", "load_checkpoint", "restore_rng", "save_checkpoint"]

CHECKPOINT_VERSION = 1
# Fields of the run configuration that must match to resume (the rest may change, e.g. epochs).
RESUME_KEYS = ("model", "data", "compress", "batch_size", "optimizer", "seed", "error_feedback")


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` returns."""

    epoch: int  # epochs completed
    step: int  # optimizer steps completed
    model: dict[str, Any]
    optimizer: dict[str, Any]
    compression: dict[str, Any]
    rng: dict[str, Any]
    config: dict[str, Any]
    world_size: int


def checkpoint_path(out_dir: str | Path, rank: int) -> Path:
    return Path(out_dir) / "checkpoint" / f"rank{rank}.pt"


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    out_dir: str | Path,
    rank: int,
    *,
    epoch: int,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    compression: dict[str, Any],
    config: dict[str, Any],
    world_size: int,
) -> Path:
    """Write this rank's checkpoint atomically; returns its path."""
    path = checkpoint_path(out_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "version": CHECKPOINT_VERSION,
        "epoch": epoch,
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "compression": compression,
        "rng": _rng_state(),
        "config": config,
        "world_size": world_size,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(body, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(
    out_dir: str | Path, rank: int, *, config: dict[str, Any], world_size: int
) -> Checkpoint:
    """Read this rank's checkpoint and check it belongs to the same run.

    Raises:
        ConfigError: no checkpoint, another version, world size or run settings differ.
    """
    path = checkpoint_path(out_dir, rank)
    if not path.exists():
        raise ConfigError(f"--resume: no checkpoint at {path}; run without --resume first")
    body = torch.load(path, map_location="cpu", weights_only=False)
    if body.get("version") != CHECKPOINT_VERSION:
        raise ConfigError(f"--resume: checkpoint version {body.get('version')} is not supported")
    if body["world_size"] != world_size:
        raise ConfigError(
            f"--resume: checkpoint was written by {body['world_size']} ranks, this run has "
            f"{world_size}; resume with --nproc {body['world_size']}"
        )
    changed = [k for k in RESUME_KEYS if body["config"].get(k) != config.get(k)]
    if changed:
        detail = ", ".join(f"{k}: {body['config'].get(k)!r} -> {config.get(k)!r}" for k in changed)
        raise ConfigError(f"--resume: settings differ from the checkpoint ({detail})")
    return Checkpoint(
        epoch=int(body["epoch"]),
        step=int(body["step"]),
        model=body["model"],
        optimizer=body["optimizer"],
        compression=body["compression"],
        rng=body["rng"],
        config=body["config"],
        world_size=int(body["world_size"]),
    )
