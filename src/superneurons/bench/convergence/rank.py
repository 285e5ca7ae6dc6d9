"""One rank of the convergence benchmark: every (task, label) in turn, the curve on rank 0.

A rank process runs :func:`rank_main` (forked on loopback by :mod:`.run`, or started inside its
network namespace by :mod:`.shaped` as ``python -m superneurons.bench.convergence.rank``).
Each label's reading for the task's optimizer (:class:`.labels.Label`) decides how it trains:
plain DDP (dense), a gradient hook (``register_compression`` with its defaults: error feedback
on; a θ schedule over the run becomes the hook's per-step schedule here, once the run's length
is known), ``CompressedAdamW`` (the optimizer communicates), ``auto``'s choice between dense
AdamW and 1-bit Adam (decided before DDP wraps, recorded as ``decision``), or DiLoCo (the task's
optimizer inside, the last window closed at the last step, evaluated on the synced model).
``curve_train_s``: rank 0's seconds since the start at each curve point, its evaluations left
out (time to a loss).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import statistics
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from superneurons.bench.convergence.config import ConvergenceConfig, TaskConfig
from superneurons.bench.convergence.labels import Label
from superneurons.localsgd.diloco import LocalSGD, attach_local_sgd
from superneurons.optim.stepcost import ComputeTimes
from superneurons.schemes.adam import AdamAuto, AdamMomentum, AdamUpdate
from superneurons.schemes.anchors import TorchDense
from superneurons.schemes.diloco import DiLoCo
from superneurons.schemes.theta import RunScheduled
from superneurons.train.rank import exit_rank, leave_process_group

__all__ = ["datasets", "evaluate", "rank_main"]


def datasets(task: TaskConfig, config: ConvergenceConfig) -> tuple[Any, Any]:
    if task.task == "fashion-mnist":
        from superneurons.data import fashion_mnist

        train = fashion_mnist(config.fashion_mnist_root, "train")
        test = fashion_mnist(config.fashion_mnist_root, "test")
        return train.tensors, test.tensors
    from superneurons.data import shakespeare

    block = int(task.model_kwargs.get("block_size", 64))
    train_set = shakespeare(config.shakespeare_root, block, "train")
    val_set = shakespeare(config.shakespeare_root, block, "val")

    def stack(ds: Any) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(ds)
        ids = ds.ids[: n * block + 1]
        return ids[:-1].view(n, block), ids[1:].view(n, block)  # (N, T), (N, T)

    return stack(train_set), stack(val_set)


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: str) -> float:
    """Test accuracy in % (classification) or mean cross-entropy (language model)."""
    model.eval()
    correct, loss_sum, count = 0.0, 0.0, 0
    with torch.no_grad():
        for start in range(0, x.shape[0], 512):
            out = model(x[start : start + 512])
            target = y[start : start + 512]
            if task == "fashion-mnist":
                correct += float((out.argmax(-1) == target).sum())
                count += target.numel()
            else:
                flat = out.reshape(-1, out.shape[-1])
                loss_sum += float(
                    nn.functional.cross_entropy(flat, target.reshape(-1), reduction="sum")
                )
                count += target.numel()
    model.train()
    return 100.0 * correct / count if task == "fashion-mnist" else loss_sum / count


def _train_one(
    task: TaskConfig,
    label: Label,
    data: tuple[Any, Any],
    rank: int,
    world: int,
    seed: int,
    adam_compute: ComputeTimes | None = None,
) -> dict[str, Any]:
    """Train ``task`` under ``label`` on this rank's shard; returns the curve (rank 0 only).
    ``adam_compute``: what ``auto`` with Adam decides from (None: measured)."""
    from superneurons.models import build_model, default_loss

    (x_train, y_train), (x_test, y_test) = data
    if task.train_limit:
        x_train, y_train = x_train[: task.train_limit], y_train[: task.train_limit]
    torch.manual_seed(seed)
    model = build_model(task.model, **task.model_kwargs)
    shard = x_train.shape[0] // world
    steps_per_epoch = shard // task.batch_size
    total = task.steps or steps_per_epoch * task.epochs
    loss_fn = default_loss(task.model)
    gen = torch.Generator().manual_seed(seed)  # the same order for every codec
    order = torch.randperm(x_train.shape[0], generator=gen)
    decision, scheme = None, label.on(task.optimizer)
    if isinstance(scheme, AdamAuto):  # dense AdamW or 1-bit Adam, decided before DDP wraps
        from superneurons.optim.autoadam import decide_adam_scheme

        first = order[rank * shard :][: task.batch_size]
        decision = decide_adam_scheme(
            model,
            (x_train[first], y_train[first]),
            loss_fn,
            config=scheme,
            total_steps=total,
            bucket_cap_bytes=25 * 2**20,  # DDP's default, as below
            compute=adam_compute,
        )
        scheme = decision.scheme
    ddp = DistributedDataParallel(model)
    state, opt = _setup(ddp, task, scheme, total, seed)
    evals = {round(total * (i + 1) / task.eval_points) for i in range(task.eval_points)}
    quick_eval, full_eval = slice(0, 2000), slice(0, task.eval_limit or x_test.shape[0])
    curve: list[list[float]] = []
    curve_train_s: list[float] = []
    start_s, start_cpu_s, step_s, eval_s = time.perf_counter(), time.process_time(), [], 0.0
    for step in range(1, total + 1):
        i = (step - 1) % steps_per_epoch
        if i == 0 and step > 1:
            order = torch.randperm(x_train.shape[0], generator=gen)
        idx = order[rank * shard :][i * task.batch_size : (i + 1) * task.batch_size]
        step_start_s = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x_train[idx]), y_train[idx])
        loss.backward()
        opt.step()
        if isinstance(state, LocalSGD):
            state.step(end_of_window=step == total)
        step_s.append(time.perf_counter() - step_start_s)  # evaluations not included
        if step in evals and rank == 0:
            eval_start_s = time.perf_counter()
            curve_train_s.append(eval_start_s - start_s - eval_s)
            part = full_eval if step == total else quick_eval
            synced = state.synced_weights() if isinstance(state, LocalSGD) else nullcontext()
            with synced:
                curve.append([step, evaluate(model, x_test[part], y_test[part], task.task)])
            eval_s += time.perf_counter() - eval_start_s
    wall_s, cpu_s = time.perf_counter() - start_s, time.process_time() - start_cpu_s
    dense_bytes = sum(4 * p.numel() for p in model.parameters() if p.requires_grad)
    sent = getattr(state, "bytes_sent_total", 0)
    return {
        "task": task.task,
        "model": task.model,
        "codec": label.text,
        "steps": total,
        "final_metric": curve[-1][1] if curve else math.nan,
        "metric": "test_accuracy_pct" if task.task == "fashion-mnist" else "val_loss_nats",
        "final_train_loss": float(loss.item()),
        "curve": curve,
        "curve_train_s": curve_train_s,
        "wall_s": wall_s,
        "cpu_s": cpu_s,  # rank 0's process time over the loop (evaluations included)
        "median_step_s": statistics.median(step_s),  # rank 0, forward to optimizer step
        "median_step_s_last_half": statistics.median(step_s[total // 2 :]),
        "bytes_sent_per_step": sent / total if sent else None,
        "dense_bytes_per_step": dense_bytes,
        "ratio_vs_dense": dense_bytes * total / sent if sent else 1.0,
        "decision": None if decision is None else decision.to_dict(),
    }


def _setup(
    ddp: DistributedDataParallel, task: TaskConfig, scheme: Any, total: int, seed: int
) -> tuple[Any, torch.optim.Optimizer]:
    """The compression state (or None) and the optimizer for a label's reading ``scheme``
    (None or ``TorchDense``: plain DDP) on a run of ``total`` steps."""
    from superneurons.optim.adam import CompressedAdamW

    decay = 0.01 if task.optimizer == "adamw" else 0.0
    state: Any = None
    if isinstance(scheme, DiLoCo):  # the task's optimizer is the inner one
        state = attach_local_sgd(ddp, scheme, seed=seed)
    elif isinstance(scheme, AdamMomentum | AdamUpdate):  # read for Adam tasks only
        from superneurons.ddp.local import register_local_gradients

        register_local_gradients(ddp)
        opt = CompressedAdamW(
            ddp.parameters(), lr=task.lr, weight_decay=decay, seed=seed, **scheme.kwargs()
        )
        return opt, opt
    elif scheme is not None and not isinstance(scheme, TorchDense):
        from superneurons.ddp.hook import register_compression
        from superneurons.schemes.compose import with_defaults

        if isinstance(scheme, RunScheduled):  # the run's length is known now
            scheme = scheme.at(total)
        state = register_compression(ddp, with_defaults(scheme), seed=seed)
    if task.optimizer == "sgd":
        return state, torch.optim.SGD(ddp.parameters(), lr=task.lr, momentum=0.9)
    return state, torch.optim.AdamW(ddp.parameters(), lr=task.lr, weight_decay=decay)


def rank_main(
    rank: int,
    config: ConvergenceConfig,
    port: int,
    out: str,
    *,
    master_addr: str = "127.0.0.1",
    ifname: str = "lo",
) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master_addr}:{port}",
        rank=rank,
        world_size=config.nproc,
        timeout=timedelta(seconds=config.timeout_s),
    )
    try:
        for task in config.tasks:
            data = datasets(task, config)
            for label in (lb for lb in config.labels if lb.on(task.optimizer) is not None):
                record = _train_one(
                    task, label, data, rank, config.nproc, config.seed, config.adam_compute
                )
                if rank == 0:
                    with open(out, "a", encoding="utf-8") as handle:
                        handle.write(json.dumps(record) + "\n")
    except BaseException:
        leave_process_group(barrier=False)  # the launcher reports the traceback
        raise
    exit_rank(0)  # this function is the rank's whole process (forked, or _shaped_rank)


def _shaped_rank(argv: list[str]) -> None:
    """One rank over a shaped link (started by :mod:`.shaped` in its namespace)."""
    config_path, rank, port, out, master_addr, ifname = argv
    config = pickle.loads(Path(config_path).read_bytes())  # noqa: S301 - our own file
    rank_main(int(rank), config, int(port), out, master_addr=master_addr, ifname=ifname)


if __name__ == "__main__":
    _shaped_rank(sys.argv[1:])
