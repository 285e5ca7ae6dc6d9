"""Everything about a training run that can be checked before any rank starts.

``superneurons train`` calls :func:`check_before_launch` in the launcher, so bad input is one
line and exit status 2 within seconds, not a rank's traceback after torchrun has started the
ranks. What is checked, in order:

1. the (model, data) pair is one the trainer knows;
2. (``--compress`` is parsed when the :class:`~superneurons.train.config.TrainConfig` is built,
   once, through the one spec grammar: codec names, ``theta`` in [0, 1), bits, ranks ...);
3. ``--data-dir`` is a directory, both splits of the dataset read completely (a truncated
   ``.gz`` or raw IDX file, an unreadable text file) and hold a sample for every rank; the
   model is built from them;
4. ``--budget`` can hold at least the resident state every plan keeps on the device: the
   parameters, their gradients and the buffers (SuperNeurons, Wang et al. PPoPP'18: "parameters,
   gradients and BN statistics stay resident"); then a memory plan exists for it, from a profile
   of one step on fake tensors (shapes only; 0.4-2 s of CPU for the trainer's models, most of
   it importing torch._dynamo, which FakeTensorMode needs).
   The ranks plan again from a real profile on their device, whose bytes can only be larger
   (allocator, cuDNN workspaces), so nothing the ranks accept is refused here;
5. ``--resume``: every rank holds a readable checkpoint of a common step, of this run.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

from torch import nn
from torch.utils.data import default_collate

from superneurons.bytesize import format_bytes
from superneurons.errors import ConfigError, DataError
from superneurons.train.checkpoint import ResumePoint, find_resume_point
from superneurons.train.config import TrainConfig
from superneurons.train.task import Task

__all__ = ["check_before_launch", "check_data_dir", "resident_bytes"]

logger = logging.getLogger("superneurons.train")


def resident_bytes(model: nn.Module) -> int:
    """Bytes every memory plan keeps on the device: parameters, a gradient for each trainable
    one, and buffers (e.g. BatchNorm statistics)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return params + grads + buffers


def check_data_dir(config: TrainConfig) -> None:
    """``--data-dir``, when given, is a directory."""
    if config.data_dir is not None and not Path(config.data_dir).is_dir():
        raise DataError(
            f"--data-dir {config.data_dir}: no such directory; pass the directory that holds "
            f"the {config.data} files, or leave --data-dir out for the default location"
        )


def _check_budget(config: TrainConfig, model: nn.Module) -> None:
    if config.budget_bytes is None:
        return
    floor_bytes = resident_bytes(model)
    if config.budget_bytes < floor_bytes:
        raise ConfigError(
            f"--budget {format_bytes(config.budget_bytes)} cannot even hold {config.model}'s "
            f"parameters, gradients and buffers ({format_bytes(floor_bytes)} = {floor_bytes} "
            f"bytes), so no memory plan fits: raise --budget or leave it out"
        )


def _check_plan(config: TrainConfig, task: Task) -> None:
    """A memory plan exists for ``--budget``: profile one step of ``config.batch_size`` samples
    on fake tensors and plan as the ranks do (``train.loop._apply_budget``)."""
    if config.budget_bytes is None:
        return
    from superneurons.memory.plan import InfeasibleBudgetError
    from superneurons.memory.planner.decide import make_plan
    from superneurons.memory.profiling.step import profile_step

    count = min(config.batch_size, len(task.train_set))  # type: ignore[arg-type]
    inputs, targets = default_collate([task.train_set[i] for i in range(count)])
    try:
        profile = profile_step(task.model, inputs, targets, task.loss_fn, fake=True)
    except ConfigError as exc:  # a step fake tensors cannot run: the ranks profile for real
        logger.info("no fake-tensor profile before launch (%s); the ranks will plan", exc)
        return
    try:
        make_plan(
            profile,
            budget_bytes=config.budget_bytes,
            allow_optimizer_in_backward=False,
            allow_weight_streaming=False,  # the ranks plan without it (DDP)
        )
    except InfeasibleBudgetError as exc:
        raise ConfigError(f"--budget: {exc} (batch {config.batch_size} per rank)") from None


def check_before_launch(
    config: TrainConfig, *, world_size: int, shared_files: bool = True
) -> ResumePoint | None:
    """Raise a one-line :class:`ConfigError` for anything wrong with ``config`` that shows
    before training; returns where ``--resume`` will continue (None without ``--resume``, or
    when the checkpoint files are not all visible here).

    ``world_size``: the ranks of the whole run (``--nproc`` times ``--nnodes``).
    ``shared_files``: every rank's checkpoint is visible here (one node, or a shared file
    system); otherwise the ranks settle the resume point among themselves once started.
    """
    from superneurons.train.task import build_task, check_task

    check_task(config.model, config.data)
    check_data_dir(config)
    task = build_task(
        config.model, config.data, data_dir=config.data_dir, block_size=config.block_size
    )
    samples = len(task.train_set)  # type: ignore[arg-type]
    if samples // world_size == 0:  # DistributedSampler(drop_last=True) gives each rank this many
        raise ConfigError(
            f"the training split has {samples} samples, fewer than the {world_size} ranks: "
            f"pass fewer ranks or more data"
        )
    _check_budget(config, task.model)
    _check_plan(config, task)
    if not config.resume or not shared_files:
        return None
    return find_resume_point(config.out_dir, config=asdict(config), world_size=world_size)
