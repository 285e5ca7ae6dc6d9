"""Per-rank training checkpoints that resume bit for bit, and survive a crash mid-save.

Each rank writes ``OUT/checkpoint/rank{r}.pt``: the model and optimizer (identical on every
rank), plus what is *not* identical across ranks — the compression state (error-feedback
residuals are local), the RNG streams (dropout) and the run's records so far (see
:class:`~superneurons.train.metrics.MetricsLog`).

Writing is atomic and keeps the previous checkpoint until the new one is complete: the body
goes to ``rank{r}.pt.tmp`` (flushed and fsync'ed), then the complete ``rank{r}.pt`` becomes
``rank{r}.prev.pt`` and the temporary file is renamed to ``rank{r}.pt`` (``os.replace``, atomic
on POSIX and Windows), then the directory is fsync'ed. A crash at any point leaves, on every
rank, a complete file of the previous save; a rank that finished the new save also holds the
new one. ``--resume`` therefore picks the newest step for which *every* rank holds a readable
file (the ranks exchange what they hold, so they cannot disagree and never hang on a mismatch).

A checkpoint is written at the end of every epoch and, with ``--checkpoint-every STEPS``, every
``STEPS`` optimizer steps inside one (``epoch_step`` says how far into its epoch it is). It holds
tensors and plain data only and is read weights-only (:mod:`superneurons.train.safeload`): a
file that would import anything else is refused, unread, as unusable.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from superneurons.errors import CheckpointError
from superneurons.train.safeload import load_weights_only, refusal

__all__ = [
    "Checkpoint",
    "ResumePoint",
    "checkpoint_path",
    "find_resume_point",
    "load_checkpoint",
    "previous_checkpoint_path",
    "remove_checkpoints",
    "restore_rng",
    "resume_checkpoint",
    "save_checkpoint",
]

logger = logging.getLogger("superneurons.train")

CHECKPOINT_VERSION = 1
# Fields of the run configuration that must match to resume (the rest may change, e.g. epochs).
RESUME_KEYS: tuple[str, ...] = ("model", "data", "compress", "batch_size", "optimizer", "seed")
RESUME_KEYS += ("error_feedback", "sync")  # sync: when ranks synchronise (train --sync)
# What a key that an older checkpoint's config lacks meant then.
_ABSENT_MEANT = {"sync": "every-step"}
_START_OVER = "remove the checkpoint directory and run without --resume to start over"


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
    metrics: dict[str, Any] = field(default_factory=dict)  # MetricsLog.state_dict(); {} if older
    path: Path | None = None  # the file it was read from
    epoch_step: int = 0  # steps done of epoch ``epoch`` (0: saved at an epoch's end)


@dataclass(frozen=True)
class ResumePoint:
    """The newest step every rank holds a readable checkpoint of."""

    step: int
    epoch: int
    paths: tuple[Path, ...]  # one per rank
    skipped: tuple[str, ...]  # newer files that could not be used, and why


def checkpoint_path(out_dir: str | Path, rank: int) -> Path:
    """The newest checkpoint of ``rank`` (``OUT/checkpoint/rank{r}.pt``)."""
    return Path(out_dir) / "checkpoint" / f"rank{rank}.pt"


def previous_checkpoint_path(out_dir: str | Path, rank: int) -> Path:
    """The checkpoint of ``rank`` before the newest (kept until a newer one is complete)."""
    return Path(out_dir) / "checkpoint" / f"rank{rank}.prev.pt"


def _temporary_path(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


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


def _fsync_directory(directory: Path) -> None:
    """Make the renames in ``directory`` durable (POSIX; a no-op where directories can't be
    opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def _reason(exc: Exception) -> str:
    """Why torch.load failed, in a few words (its own messages run to several lines)."""
    text = str(exc)
    if "central directory" in text:
        return "truncated: its zip archive ends early"
    if "zipfile" in text or "load key" in text or isinstance(exc, EOFError):
        return "not a torch.save zip archive: corrupt or another kind of file"
    first = text.strip().split("\n")[0].split(". ")[0]
    return f"corrupt: {first[:100]}" if first else f"corrupt: {type(exc).__name__}"


def _try_read(path: Path, *, mmap: bool) -> tuple[dict[str, Any] | None, str]:
    """``(body, "")`` for a readable checkpoint, else ``(None, why not)``."""
    try:
        body = load_weights_only(path, mmap=mmap)  # a folder from elsewhere runs no code
    except FileNotFoundError:
        return None, "no such file"
    except Exception as exc:  # noqa: BLE001 - whatever torch.load raises, the file is unusable
        return None, refusal(exc) or _reason(exc)
    if not isinstance(body, dict) or body.get("version") != CHECKPOINT_VERSION:
        version = body.get("version") if isinstance(body, dict) else None
        return None, f"not a superneurons checkpoint of version {CHECKPOINT_VERSION} ({version!r})"
    if not isinstance(body.get("step"), int):
        return None, "corrupt: no step count"
    return body, ""


def _read(path: Path, *, mmap: bool = False) -> dict[str, Any]:
    """The body of a checkpoint file; any failure is one :class:`CheckpointError` line."""
    body, why = _try_read(path, mmap=mmap)
    if body is None:
        raise CheckpointError(f"{path}: unusable checkpoint ({why}); {_START_OVER}")
    return body


def _readable_step(path: Path) -> int | None:
    """The step of a checkpoint file, or None when it is missing or unreadable (cheap: the
    tensors are memory-mapped, not read)."""
    body, _ = _try_read(path, mmap=True)
    return None if body is None else int(body["step"])


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
    metrics: dict[str, Any] | None = None,
    epoch_step: int = 0,
) -> Path:
    """Write this rank's checkpoint atomically, keeping the previous one; returns its path.

    ``epoch`` counts the epochs completed; ``epoch_step`` the steps done of the next one (a
    checkpoint inside an epoch), 0 at an epoch's end."""
    path = checkpoint_path(out_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "version": CHECKPOINT_VERSION,
        "epoch": epoch,
        "epoch_step": epoch_step,
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "compression": compression,
        "rng": _rng_state(),
        "config": config,
        "world_size": world_size,
        "metrics": metrics or {},
    }
    tmp = _temporary_path(path)
    with tmp.open("wb") as handle:
        torch.save(body, handle)
        handle.flush()
        os.fsync(handle.fileno())
    # NOTE: keep the newest *readable* file as the previous one: after resuming from
    # rank.prev.pt because rank.pt was damaged, the damaged file must not replace it.
    if _readable_step(path) is not None:
        os.replace(path, previous_checkpoint_path(out_dir, rank))
    os.replace(tmp, path)
    _fsync_directory(path.parent)
    return path


def remove_checkpoints(out_dir: str | Path, rank: int) -> list[Path]:
    """Delete ``rank``'s checkpoint files (a run that starts over); returns those removed."""
    removed = []
    newest = checkpoint_path(out_dir, rank)
    for path in (newest, previous_checkpoint_path(out_dir, rank), _temporary_path(newest)):
        if path.exists():
            path.unlink()
            removed.append(path)
    return removed


def _readable_files(out_dir: str | Path, rank: int) -> tuple[dict[int, Path], list[str]]:
    """Steps of ``rank``'s readable checkpoint files (newest file first wins a tie), and why
    the others were skipped."""
    steps: dict[int, Path] = {}
    problems: list[str] = []
    for path in (checkpoint_path(out_dir, rank), previous_checkpoint_path(out_dir, rank)):
        if not path.is_file():
            continue
        body, why = _try_read(path, mmap=True)
        if body is None:
            problems.append(f"{path.name}: {why}")
            continue
        steps.setdefault(int(body["step"]), path)
    return steps, problems


def _choose(held: dict[int, set[int]], problems: list[str], directory: Path) -> int:
    """The newest step every rank in ``held`` (rank -> steps it can read) holds."""
    common = set.intersection(*held.values()) if held else set()
    if common:
        return max(common)
    if not any(held.values()) and not problems:
        raise CheckpointError(f"--resume: no checkpoint in {directory}; run without --resume")
    empty = [f"rank {rank} has none" for rank, steps in held.items() if not steps]
    detail = "; ".join(problems + empty) or "the ranks hold checkpoints of different steps"
    raise CheckpointError(
        f"--resume: no checkpoint in {directory} that every rank can read ({detail}); {_START_OVER}"
    )


def _check_same_run(
    body: dict[str, Any], path: Path, config: dict[str, Any], world_size: int
) -> None:
    if body["world_size"] != world_size:
        raise CheckpointError(
            f"--resume: {path} was written by {body['world_size']} ranks, this run has "
            f"{world_size}; resume with --nproc {body['world_size']} (times --nnodes)"
        )
    saved = {k: body["config"].get(k, _ABSENT_MEANT.get(k)) for k in RESUME_KEYS}
    changed = [k for k in RESUME_KEYS if saved[k] != config.get(k, _ABSENT_MEANT.get(k))]
    if changed:
        detail = ", ".join(f"{k}: {saved[k]!r} -> {config.get(k)!r}" for k in changed)
        raise CheckpointError(f"--resume: settings differ from {path} ({detail})")


def find_resume_point(
    out_dir: str | Path, *, config: dict[str, Any], world_size: int
) -> ResumePoint:
    """Which checkpoint ``--resume`` continues from, read from every rank's files: the
    launcher's check before any rank starts (it assumes the ranks share a file system).

    Raises:
        CheckpointError: no step that every rank holds a readable file of, or the checkpoint
            belongs to another run (world size, the settings in ``RESUME_KEYS``).
    """
    held: dict[int, set[int]] = {}
    problems: list[str] = []
    files = []
    for rank in range(world_size):
        steps, rank_problems = _readable_files(out_dir, rank)
        held[rank] = set(steps)
        problems += rank_problems
        files.append(steps)
    if files and files[0]:  # another world size says so, not "rank 1 has none"
        newest = files[0][max(files[0])]
        _check_same_run(_read(newest, mmap=True), newest, config, world_size)
    step = _choose(held, problems, Path(out_dir) / "checkpoint")
    paths = tuple(steps[step] for steps in files)
    body = _read(paths[0], mmap=True)
    _check_same_run(body, paths[0], config, world_size)
    return ResumePoint(step=step, epoch=int(body["epoch"]), paths=paths, skipped=tuple(problems))


def load_checkpoint(
    out_dir: str | Path,
    rank: int,
    *,
    config: dict[str, Any],
    world_size: int,
    step: int | None = None,
) -> Checkpoint:
    """Read this rank's checkpoint (of ``step``; default the newest readable one) and check
    it belongs to the same run.

    Raises:
        CheckpointError: no readable checkpoint (of that step), another version, world size
            or run settings differ.
    """
    steps, problems = _readable_files(out_dir, rank)
    if step is None:
        step = _choose({rank: set(steps)}, problems, Path(out_dir) / "checkpoint")
    if step not in steps:
        detail = "; ".join(problems) or f"it holds steps {sorted(steps)}"
        raise CheckpointError(
            f"--resume: rank {rank} has no readable checkpoint of step {step} ({detail}); "
            f"{_START_OVER}"
        )
    path = steps[step]
    body = _read(path)
    _check_same_run(body, path, config, world_size)
    return Checkpoint(
        epoch=int(body["epoch"]),
        step=int(body["step"]),
        model=body["model"],
        optimizer=body["optimizer"],
        compression=body["compression"],
        rng=body["rng"],
        config=body["config"],
        world_size=int(body["world_size"]),
        metrics=dict(body.get("metrics") or {}),
        path=path,
        epoch_step=int(body.get("epoch_step", 0)),
    )


@overload
def resume_checkpoint(
    out_dir: str | Path,
    rank: int,
    *,
    config: dict[str, Any],
    world_size: int,
    missing_ok: Literal[False] = False,
) -> Checkpoint: ...


@overload
def resume_checkpoint(
    out_dir: str | Path, rank: int, *, config: dict[str, Any], world_size: int, missing_ok: bool
) -> Checkpoint | None: ...


def resume_checkpoint(
    out_dir: str | Path,
    rank: int,
    *,
    config: dict[str, Any],
    world_size: int,
    missing_ok: bool = False,
) -> Checkpoint | None:
    """Inside the process group: every rank says which steps it holds readable checkpoints
    of, all take the newest step common to all, and each loads its own file of that step.

    Every rank takes part in the exchange before anything can fail, so a rank with a missing
    or damaged file makes *all* ranks raise the same :class:`CheckpointError` — no rank waits
    on a collective the others never reach. ``missing_ok``: no step that every rank holds
    returns None on every rank instead (workers restarted before their first common
    checkpoint start over).
    """
    steps, problems = _readable_files(out_dir, rank)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (sorted(steps), problems))
    held = {r: set(rank_steps) for r, (rank_steps, _) in enumerate(gathered)}
    if missing_ok and not set.intersection(*held.values()):
        if rank == 0:  # the same answer on every rank: they all gathered the same
            holdings = ", ".join(f"rank {r}: {sorted(s) or 'none'}" for r, s in held.items())
            skipped = [p for _, rank_problems in gathered for p in rank_problems]
            logger.warning(
                "no checkpoint step that every rank holds (%s)%s",
                holdings,
                f"; skipped {'; '.join(skipped)}" if skipped else "",
            )
        return None
    all_problems = [p for _, rank_problems in gathered for p in rank_problems]
    step = _choose(held, all_problems, Path(out_dir) / "checkpoint")
    return load_checkpoint(out_dir, rank, config=config, world_size=world_size, step=step)
