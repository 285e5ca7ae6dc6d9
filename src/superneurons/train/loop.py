"""The data-parallel training loop of ``superneurons train``: one plain function.

Per rank: seed, build the model and data, wrap in DDP, attach the synchronisation (gradient
compression through DDP's hook, or an optimizer that communicates itself:
:mod:`superneurons.train.sync`), then for each epoch train over this
rank's shard (``DistributedSampler``), evaluate on the test split, checkpoint (and every
``checkpoint_every`` steps inside an epoch). ``--resume`` loads the newest checkpoint every rank
holds and continues exactly where an uninterrupted run would be, mid-epoch included, records
included (``summary.json`` counts every step, ``metrics.jsonl`` holds each step once); a run
without ``--resume`` starts over and removes an earlier run's checkpoint.

Workers that torchrun restarted after a failure (``--max-restarts``; ``TORCHELASTIC_RESTART_COUNT``
> 0) resume by themselves: from the newest checkpoint every rank can read, or from the start if
there is none yet, so at most ``checkpoint_every`` steps (or an epoch) are computed again.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from superneurons.device import Placement
from superneurons.errors import ConfigError
from superneurons.train.checkpoint import (
    Checkpoint,
    remove_checkpoints,
    restore_rng,
    resume_checkpoint,
    save_checkpoint,
)
from superneurons.train.config import TrainConfig
from superneurons.train.metrics import MetricsLog, last_logged_step, summarize, write_summary
from superneurons.train.rank import init_distributed, leave_process_group
from superneurons.train.sync import (
    attach_synchronisation,
    build_optimizer,
    communicating_optimizer,
    decide_scheme,
)
from superneurons.train.task import Task, build_task

__all__ = ["restart_count", "run_training", "train"]

logger = logging.getLogger("superneurons.train")


def train(config: TrainConfig) -> dict[str, Any]:
    """Run ``config`` on this rank (inside torchrun); returns the summary (rank 0 writes it).

    Joins the process group and leaves it (:func:`~superneurons.train.rank.leave_process_group`);
    a process that ends after it should end through :func:`~superneurons.train.rank.exit_rank`,
    as ``superneurons train``'s ranks do."""
    torch.set_num_threads(1)  # NOTE: ranks share the cores; more threads made small ops 30x slower
    placement = init_distributed(config.backend)
    finished = False
    try:
        summary = run_training(config, placement)
        finished = True
        return summary
    finally:  # NOTE: no barrier after a failure: a peer may never arrive
        leave_process_group(barrier=finished)


def run_training(config: TrainConfig, device: Placement | torch.device) -> dict[str, Any]:
    """The loop itself, in an already initialised process group (tests call it directly).

    Every model, batch and target reaches the rank's device through one
    :class:`~superneurons.device.Placement` (a bare device means ``Placement(device)``).
    """
    placement = Placement.of(device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config.seed)  # same initial weights on every rank
    random.seed(config.seed)  # NOTE: checkpointed too; unseeded it differs run to run
    task = build_task(
        config.model, config.data, data_dir=config.data_dir, block_size=config.block_size
    )
    model = placement.module(task.model)
    sampler: DistributedSampler[Any] = DistributedSampler(
        task.train_set, seed=config.seed, drop_last=True
    )
    loader = DataLoader(
        task.train_set,
        batch_size=config.batch_size,
        sampler=sampler,
        pin_memory=placement.pin_memory,
    )
    if len(loader) == 0:
        raise ConfigError(f"--batch-size {config.batch_size} leaves no batch per rank")
    plan_handle = None
    if config.budget_bytes is not None:
        batch = placement.batch(next(iter(loader)))  # profiled where it will run
        factory = None
        if not communicating_optimizer(config):  # the host optimizer can stand in for it
            factory = functools.partial(build_optimizer, config)
        plan_handle = _apply_budget(
            model, batch, config.budget_bytes, loss_fn=task.loss_fn, optimizer_factory=factory
        )
    saved = _resume_or_start_over(config, rank, world_size)
    steps_per_epoch = min(len(loader), config.limit_steps or len(loader))

    def first_batch() -> Any:
        with torch.random.fork_rng(devices=[]):  # NOTE: a DataLoader iterator draws a seed
            return placement.batch(next(iter(loader)))

    decision = decide_scheme(  # auto with Adam(W): measured before DDP wraps the model
        config,
        model,
        batch=first_batch,
        loss_fn=task.loss_fn,
        total_steps=steps_per_epoch * config.epochs,
        saved=None if saved is None else saved.compression,
    )
    ddp = DistributedDataParallel(model, bucket_cap_mb=config.bucket_cap_mb)
    host = plan_handle.optimizer if plan_handle is not None else None
    if plan_handle is not None and host is not None:
        plan_handle.attach(ddp)  # the buckets run the comm hook registered next
    optimizer, compression = attach_synchronisation(
        config, model, ddp, decision=decision, optimizer=host
    )
    start_epoch = step = done_in_epoch = 0
    if saved is not None:
        model.load_state_dict(saved.model)
        optimizer.load_state_dict(saved.optimizer)
        compression.load_state_dict(saved.compression)
        restore_rng(saved.rng)
        start_epoch, step, done_in_epoch = saved.epoch, saved.step, saved.epoch_step
    compression.check_replicas(ddp, optimizer)  # what must be equal on every rank
    test = {"test_loss": float("nan"), "test_accuracy": float("nan")}
    resume_at = None if saved is None else (saved.epoch, saved.step)
    restart = restart_count()
    logged = last_logged_step(Path(config.out_dir) / "metrics.jsonl") if rank == 0 else None
    with MetricsLog(config.out_dir, enabled=rank == 0, resume_at=resume_at) as log:
        if saved is not None:
            log.load_state_dict(saved.metrics or {"steps": saved.step})
        if saved is not None or restart:
            step_from = 0 if saved is None else saved.step
            log.note_resume(step=step_from, restart=restart, last_logged_step=logged)
        for epoch in range(start_epoch, config.epochs):
            sampler.set_epoch(epoch)
            ddp.train()
            progress = _progress(steps_per_epoch, f"epoch {epoch + 1}/{config.epochs}", rank)
            if done_in_epoch:  # NOTE: a DataLoader iterator draws a seed; the checkpoint's
                with torch.random.fork_rng(devices=[]):  # RNG state came after that draw
                    batches = iter(loader)
                if progress is not None:
                    progress.update(done_in_epoch)
            else:
                batches = iter(loader)
            for index, (inputs, targets) in enumerate(batches):
                if index >= steps_per_epoch:
                    break
                if index < done_in_epoch:
                    continue  # done before the checkpoint this run resumed from
                inputs, targets = placement.batch((inputs, targets))
                step_start_s = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                output = ddp(inputs)
                loss = task.loss_fn(output, targets)
                loss.backward()
                optimizer.step()
                compression.after_step(end_of_epoch=index == steps_per_epoch - 1)  # DiLoCo
                step_s = time.perf_counter() - step_start_s
                loss_value = float(loss.detach())
                step += 1
                log.record_step_time(
                    step_s=step_s,
                    bytes_sent=compression.bytes_sent_step,
                    dense_bytes=compression.dense_bytes_step,
                )
                if step % config.log_every == 0 or index == steps_per_epoch - 1:
                    log.write(
                        "step",
                        step=step,
                        epoch=epoch,
                        loss=loss_value,
                        accuracy=_accuracy(output, targets),
                        bytes_sent=compression.bytes_sent_step,
                        step_s=step_s,
                    )
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(loss=f"{loss_value:.3f}")
                every = config.checkpoint_every
                if every is not None and step % every == 0 and index < steps_per_epoch - 1:
                    save_checkpoint(  # inside the epoch; its last step is saved below
                        config.out_dir,
                        rank,
                        epoch=epoch,
                        epoch_step=index + 1,
                        step=step,
                        model=model,
                        optimizer=optimizer,
                        compression=compression.state_dict(),
                        config=asdict(config),
                        world_size=world_size,
                        metrics=log.state_dict(),
                    )
            done_in_epoch = 0
            if progress is not None:
                progress.close()
            test = _evaluate(ddp.module, task, config, device)
            log.write("epoch", epoch=epoch, step=step, wall_s=log.wall_s, **test)
            save_checkpoint(
                config.out_dir,
                rank,
                epoch=epoch + 1,
                step=step,
                model=model,
                optimizer=optimizer,
                compression=compression.state_dict(),
                config=asdict(config),
                world_size=world_size,
                metrics=log.state_dict(),
            )
        summary = summarize(
            log,
            model=config.model,
            data=config.data,
            codec=compression.codec,
            **compression.summary(),
            world_size=world_size,
            restarts=restart,
            epochs=config.epochs,
            wall_s=log.wall_s,
            final_test_accuracy=test["test_accuracy"],
            final_test_loss=test["test_loss"],
            parameters=sum(p.numel() for p in model.parameters()),
            device=str(placement.device),
            backend=dist.get_backend(),
            torch_version=torch.__version__,
        )
    if plan_handle is not None:
        plan_handle.remove()
    if rank == 0:
        write_summary(config.out_dir, summary)
    return summary


def _accuracy(output: torch.Tensor, targets: torch.Tensor) -> float:
    return float((output.argmax(dim=-1) == targets).float().mean())


@torch.no_grad()
def _evaluate(
    model: nn.Module, task: Task, config: TrainConfig, device: Placement | torch.device
) -> dict[str, float]:
    """Loss and accuracy on the test split, each rank a shard, summed by all-reduce."""
    placement = Placement.of(device)
    model.eval()
    sampler: DistributedSampler[Any] = DistributedSampler(task.test_set, shuffle=False)
    loader = DataLoader(
        task.test_set,
        batch_size=config.batch_size,
        sampler=sampler,
        pin_memory=placement.pin_memory,
    )
    # loss sum, correct, count (fp64 on the device: NCCL all-reduces device tensors)
    totals = torch.zeros(3, dtype=torch.float64, device=placement.device)
    for index, (inputs, targets) in enumerate(loader):
        if config.limit_steps is not None and index >= config.limit_steps:
            break
        inputs, targets = placement.batch((inputs, targets))
        output = model(inputs)
        count = targets.numel()
        totals[0] += float(task.loss_fn(output, targets)) * count
        totals[1] += float((output.argmax(dim=-1) == targets).sum())
        totals[2] += count
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / max(count, 1), "test_accuracy": correct / max(count, 1)}


def restart_count() -> int:
    """How many times torchrun's elastic agent has restarted this run's workers (0: the first
    start, or not under torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _resume_or_start_over(config: TrainConfig, rank: int, world_size: int) -> Checkpoint | None:
    """``--resume``: the checkpoint all ranks agree on. Workers torchrun restarted: the same,
    or a fresh start when no checkpoint is common to every rank yet. Otherwise remove an
    earlier run's checkpoint, so that a later ``--resume`` can never mix its files with this
    run's."""
    restarted = restart_count()
    if config.resume or restarted:
        saved = resume_checkpoint(
            config.out_dir,
            rank,
            config=asdict(config),
            world_size=world_size,
            missing_ok=not config.resume,
        )
        if restarted and rank == 0:
            where = "the start" if saved is None else f"step {saved.step} (epoch {saved.epoch + 1})"
            logger.warning("workers restarted (restart %d): continuing from %s", restarted, where)
        if saved is not None:
            return saved
    removed = remove_checkpoints(config.out_dir, rank)
    if removed and rank == 0 and not restarted:
        logger.warning(
            "starting over in %s: removed the earlier run's checkpoint (pass --resume to "
            "continue a run instead)",
            config.out_dir,
        )
    return None


def _progress(total: int, description: str, rank: int) -> Any:
    """Rank 0's progress on stderr: a live bar on a terminal, a plain line every ~10 s in a
    log (:func:`superneurons.train.progress.progress_bar`)."""
    from superneurons.train.progress import progress_bar

    if rank != 0:
        return None
    return progress_bar(total, desc=description, unit="step", leave=False)


def _apply_budget(
    model: nn.Module,
    batch: Any,
    budget_bytes: int,
    *,
    loss_fn: Any,
    optimizer_factory: Callable[[list[Any]], torch.optim.Optimizer] | None = None,
) -> Any:
    """Fit training under ``budget_bytes`` of device memory (SuperNeurons, Wang et al.
    PPoPP'18): profile one step, plan keep/offload/recompute, apply the plan to ``model``.

    With ``optimizer_factory`` (the loop's optimizer) its state counts in the profile, and the
    planner may put the optimizer on the host (``offload+host-optimizer``, applied here before
    DDP wraps the model; the handle's ``optimizer`` is then the loop's).

    The seam to the memory runtime: the only place the trainer touches it. Returns the plan
    handle (kept alive for the whole run).
    """
    try:
        from superneurons.memory.planner.decide import make_plan
        from superneurons.memory.profiling.step import profile_step
        from superneurons.memory.runtime.apply import apply_plan
    except ImportError as exc:
        raise ConfigError(f"--budget needs the memory runtime ({exc})") from exc
    inputs, targets = batch
    optimizer = optimizer_factory(list(model.parameters())) if optimizer_factory else None
    profile = profile_step(model, inputs, targets, loss_fn, optimizer)
    # NOTE: no optimizer-in-backward under DDP: it would step before the all-reduce.
    plan = make_plan(
        profile,
        budget_bytes=budget_bytes,
        allow_optimizer_in_backward=False,
        allow_host_optimizer=optimizer_factory is not None,
    )
    logger.info("memory plan for a budget of %d bytes: %s", budget_bytes, plan)
    return apply_plan(model, plan, optimizer_factory=optimizer_factory)
