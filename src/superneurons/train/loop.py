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
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
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
from superneurons.train.evaluate import batch_accuracy, evaluate
from superneurons.train.metrics import MetricsLog, last_logged_step, summarize, write_summary
from superneurons.train.rank import init_distributed, leave_process_group
from superneurons.train.sync import (
    Synchronisation,
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


@dataclass
class _Run:
    """One rank's training, built once by :func:`_build`: the task and model, the data, and
    how ranks synchronise (the DDP wrapper, the optimizer, the wire)."""

    config: TrainConfig
    placement: Placement
    rank: int
    world_size: int
    task: Task
    model: nn.Module
    sampler: DistributedSampler[Any]
    loader: DataLoader[Any]
    steps_per_epoch: int
    plan_handle: Any
    ddp: DistributedDataParallel
    optimizer: torch.optim.Optimizer
    compression: Synchronisation
    grad_norm: float | None = None  # the last step's global gradient norm (--max-grad-norm)


def run_training(config: TrainConfig, device: Placement | torch.device) -> dict[str, Any]:
    """The loop itself, in an already initialised process group (tests call it directly).

    Every model, batch and target reaches the rank's device through one
    :class:`~superneurons.device.Placement` (a bare device means ``Placement(device)``).
    """
    run, saved = _build(config, Placement.of(device))
    start_epoch, step, done_in_epoch = _restore(run, saved)
    run.compression.check_replicas(run.ddp, run.optimizer)  # what must be equal on every rank
    test = {"test_loss": float("nan"), "test_accuracy": float("nan")}
    restart = restart_count()
    logged = last_logged_step(Path(config.out_dir) / "metrics.jsonl") if run.rank == 0 else None
    resume_at = None if saved is None else (saved.epoch, saved.step)
    with MetricsLog(config.out_dir, enabled=run.rank == 0, resume_at=resume_at) as log:
        if saved is not None:
            log.load_state_dict(saved.metrics or {"steps": saved.step})
        if saved is not None or restart:
            step_from = 0 if saved is None else saved.step
            log.note_resume(step=step_from, restart=restart, last_logged_step=logged)
        if _clocked(config) and step == 0:  # the curve's first point: the initial weights
            _evaluate(run, log, step=0)
        for epoch in range(start_epoch, config.epochs):
            step, stopped_at = _train_epoch(
                run, log, epoch=epoch, step=step, done_in_epoch=done_in_epoch
            )
            done_in_epoch = 0
            test = _evaluate(run, log, step=step)
            if stopped_at is None or stopped_at >= run.steps_per_epoch:  # a whole epoch
                log.write("epoch", epoch=epoch, step=step, wall_s=log.wall_s, **test)
                _save(run, log, epoch=epoch + 1, step=step)
            else:  # the time budget ran out inside the epoch
                _save(run, log, epoch=epoch, step=step, epoch_step=stopped_at)
            if stopped_at is not None:
                break
        summary = _summary(run, log, test=test, restarts=restart)
    if run.plan_handle is not None:
        run.plan_handle.remove()
    if run.rank == 0:
        write_summary(config.out_dir, summary)
    return summary


def _build(config: TrainConfig, placement: Placement) -> tuple[_Run, Checkpoint | None]:
    """Seed, build the task, the data and the memory plan, find the checkpoint to resume
    from, decide ``auto`` (Adam), wrap the model in DDP and attach the synchronisation."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config.seed)  # same initial weights on every rank
    random.seed(config.seed)  # NOTE: checkpointed too; unseeded it differs run to run
    task = build_task(
        config.model, config.data, data_dir=config.data_dir, block_size=config.block_size
    )
    model = placement.module(task.model)
    sampler, loader = _data(config, task, placement)
    plan_handle = _plan(config, model, loader, placement, task)
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
    run = _Run(
        config, placement, rank, world_size, task, model, sampler, loader, steps_per_epoch,
        plan_handle, ddp, optimizer, compression,
    )  # fmt: skip
    return run, saved


def _data(
    config: TrainConfig, task: Task, placement: Placement
) -> tuple[DistributedSampler[Any], DataLoader[Any]]:
    """This rank's shard of the training split (``DistributedSampler``), in batches."""
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
    return sampler, loader


def _plan(
    config: TrainConfig, model: nn.Module, loader: DataLoader[Any], placement: Placement, task: Task
) -> Any:
    """``--budget``: the memory plan applied to ``model`` (its handle), else None."""
    if config.budget_bytes is None:
        return None
    batch = placement.batch(next(iter(loader)))  # profiled where it will run
    factory = None
    if not communicating_optimizer(config):  # the host optimizer can stand in for it
        factory = functools.partial(build_optimizer, config)
    return _apply_budget(
        model,
        batch,
        config.budget_bytes,
        loss_fn=task.loss_fn,
        optimizer_factory=factory,
        max_grad_norm=config.max_grad_norm,
    )


def _restore(run: _Run, saved: Checkpoint | None) -> tuple[int, int, int]:
    """Load a checkpoint's model, optimizer, wire and RNG state; returns where the run goes on:
    ``(epoch, step, steps done in that epoch)``."""
    if saved is None:
        return 0, 0, 0
    run.model.load_state_dict(saved.model)
    run.optimizer.load_state_dict(saved.optimizer)
    run.compression.load_state_dict(saved.compression)
    restore_rng(saved.rng)
    return saved.epoch, saved.step, saved.epoch_step


def _batches(run: _Run, done_in_epoch: int) -> Iterator[Any]:
    """This epoch's batches; a resumed epoch draws its iterator's seed outside the RNG stream
    (NOTE: a DataLoader iterator draws a seed; the checkpoint's RNG state came after that
    draw)."""
    if not done_in_epoch:
        return iter(run.loader)
    with torch.random.fork_rng(devices=[]):
        return iter(run.loader)


def _clocked(config: TrainConfig) -> bool:
    return config.time_budget_s is not None or config.eval_every_s is not None


def _evaluate(run: _Run, log: MetricsLog, *, step: int) -> dict[str, float]:
    """The test split's loss and accuracy; with a clock, timed (left out of ``train_s``) and
    recorded as an eval record."""
    start_s = time.perf_counter()
    train_s = log.train_s
    test = evaluate(run.ddp.module, run.task, run.config, run.placement)
    run.ddp.train()
    if _clocked(run.config):
        log.eval_s += time.perf_counter() - start_s
        log.last_eval_train_s = train_s
        log.write("eval", step=step, train_s=train_s, wall_s=log.wall_s, **test)
    return test


def _check_clock(run: _Run, log: MetricsLog) -> tuple[bool, bool]:
    """``(evaluate now, stop now)`` by rank 0's clock, the same on every rank (one broadcast
    of two flags: ranks that disagreed would wait in different collectives)."""
    config, train_s = run.config, log.train_s
    every, last = config.eval_every_s, log.last_eval_train_s
    due = every is not None and train_s >= (0.0 if last is None else last) + every
    stop = config.time_budget_s is not None and train_s >= config.time_budget_s
    flags = torch.tensor([int(due), int(stop)], dtype=torch.int64, device=run.placement.device)
    dist.broadcast(flags, src=0)
    return bool(flags[0]), bool(flags[1])


def _train_epoch(
    run: _Run, log: MetricsLog, *, epoch: int, step: int, done_in_epoch: int
) -> tuple[int, int | None]:
    """Train one epoch from its step ``done_in_epoch`` on, logging and checkpointing as asked;
    returns the steps done so far in the run and, where the time budget stopped training, the
    steps of this epoch done (else None)."""
    config, total = run.config, run.steps_per_epoch
    run.sampler.set_epoch(epoch)
    run.ddp.train()
    progress = _progress(total, f"epoch {epoch + 1}/{config.epochs}", run.rank)
    if progress is not None and done_in_epoch:
        progress.update(done_in_epoch)
    for index, (inputs, targets) in enumerate(_batches(run, done_in_epoch)):
        if index >= total:
            break
        if index < done_in_epoch:
            continue  # done before the checkpoint this run resumed from
        last = index == total - 1
        output, targets, loss_value, step_s = _train_step(run, inputs, targets, last=last)
        step += 1
        sent = run.compression.bytes_sent_step
        log.record_step_time(
            step_s=step_s, bytes_sent=sent, dense_bytes=run.compression.dense_bytes_step
        )
        if step % config.log_every == 0 or last:
            accuracy = batch_accuracy(output, targets)
            norm = {} if run.grad_norm is None else {"grad_norm": run.grad_norm}
            log.write("step", step=step, epoch=epoch, loss=loss_value, accuracy=accuracy,
                      bytes_sent=sent, step_s=step_s, **norm)  # fmt: skip
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{loss_value:.3f}")
        every = config.checkpoint_every
        if every is not None and step % every == 0 and not last:  # the last: saved after it
            _save(run, log, epoch=epoch, step=step, epoch_step=index + 1)
        if _clocked(config):
            due, stop = _check_clock(run, log)
            if stop:
                if progress is not None:
                    progress.close()
                return step, index + 1
            if due and not last:  # the epoch's own evaluation follows its last step
                _evaluate(run, log, step=step)
    if progress is not None:
        progress.close()
    return step, None


def _train_step(
    run: _Run, inputs: Any, targets: Any, *, last: bool
) -> tuple[torch.Tensor, Any, float, float]:
    """One optimizer step: ``(output, targets on the device, loss, seconds)``."""
    inputs, targets = run.placement.batch((inputs, targets))
    start_s = time.perf_counter()
    run.optimizer.zero_grad(set_to_none=True)
    output = run.ddp(inputs)
    loss = run.task.loss_fn(output, targets)
    loss.backward()
    if run.config.max_grad_norm:
        run.grad_norm = float(_clip(run))
    run.optimizer.step()
    run.compression.after_step(end_of_epoch=last)  # DiLoCo
    step_s = time.perf_counter() - start_s
    return output, targets, float(loss.detach()), step_s


def _clip(run: _Run) -> torch.Tensor:
    """``--max-grad-norm``: clip the averaged gradients by their global norm (on the host
    where the optimizer is there: its ``clip_grad_norm_``); returns the norm before."""
    from superneurons.memory.offload.host_grads import clip_grad_norm_

    host_clip = getattr(run.optimizer, "clip_grad_norm_", None)  # HostOptimizerView
    if host_clip is not None:
        return host_clip(run.config.max_grad_norm)
    return clip_grad_norm_(run.model.parameters(), run.config.max_grad_norm)


def _save(run: _Run, log: MetricsLog, *, epoch: int, step: int, epoch_step: int = 0) -> None:
    """This rank's checkpoint: ``epoch`` epochs and ``epoch_step`` steps of the next done."""
    save_checkpoint(
        run.config.out_dir,
        run.rank,
        epoch=epoch,
        epoch_step=epoch_step,
        step=step,
        model=run.model,
        optimizer=run.optimizer,
        compression=run.compression.state_dict(),
        config=asdict(run.config),
        world_size=run.world_size,
        metrics=log.state_dict(),
    )


def _summary(
    run: _Run, log: MetricsLog, *, test: dict[str, float], restarts: int
) -> dict[str, Any]:
    config = run.config
    return summarize(
        log,
        model=config.model,
        data=config.data,
        codec=run.compression.codec,
        **run.compression.summary(),
        world_size=run.world_size,
        restarts=restarts,
        epochs=config.epochs,
        wall_s=log.wall_s,
        train_s=log.train_s,
        final_test_accuracy=test["test_accuracy"],
        final_test_loss=test["test_loss"],
        parameters=sum(p.numel() for p in run.model.parameters()),
        device=str(run.placement.device),
        backend=dist.get_backend(),
        torch_version=torch.__version__,
    )


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
    max_grad_norm: float = 0.0,
) -> Any:
    """Fit training under ``budget_bytes`` of device memory (SuperNeurons, Wang et al.
    PPoPP'18): profile one step, plan keep/offload/recompute, apply the plan to ``model``.

    With ``optimizer_factory`` (the loop's optimizer) its state counts in the profile, and the
    planner may put the optimizer on the host (``offload+host-optimizer``, applied here before
    DDP wraps the model; the handle's ``optimizer`` is then the loop's); with
    ``max_grad_norm`` the plan is made for a step that clips (the host optimizer's waits for
    the global norm).

    The seam to the memory runtime: the only place the trainer touches it. Returns the plan
    handle (kept alive for the whole run).
    """
    try:
        from superneurons.memory.plan import TrainingStep
        from superneurons.memory.planner.decide import make_plan
        from superneurons.memory.profiling.step import profile_step
        from superneurons.memory.runtime.apply import apply_plan
        from superneurons.memory.runtime.ranks import planned_on_rank_zero
    except ImportError as exc:
        raise ConfigError(f"--budget needs the memory runtime ({exc})") from exc
    inputs, targets = batch

    def plan_on_this_rank() -> Any:
        optimizer = optimizer_factory(list(model.parameters())) if optimizer_factory else None
        profile = profile_step(model, inputs, targets, loss_fn, optimizer)
        # NOTE: no optimizer-in-backward under DDP: it would step before the all-reduce.
        return make_plan(
            profile,
            budget_bytes=budget_bytes,
            allow_optimizer_in_backward=False,
            allow_host_optimizer=optimizer_factory is not None,
            # streamed weights are one device's: the trainer wraps every model in DDP (one rank
            # too), and under data parallelism FSDP2 shards weights instead
            allow_weight_streaming=False,
            step=TrainingStep(max_grad_norm=max_grad_norm) if max_grad_norm else None,
        )

    plan = planned_on_rank_zero(plan_on_this_rank)  # one plan for all ranks, or one error
    logger.info("memory plan for a budget of %d bytes: %s", budget_bytes, plan)
    return apply_plan(model, plan, optimizer_factory=optimizer_factory)
