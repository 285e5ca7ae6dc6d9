"""The convergence benchmark: does a codec reach dense DDP's accuracy in the same steps?

Every codec trains the same model from the same initial weights on the same data order with
2 gloo ranks on loopback (one thread each), through ``register_compression`` with its
defaults (error feedback on). Two tasks:

* Fashion-MNIST (Xiao et al., 2017) image classification, the same epochs for every codec;
  the metric is test accuracy in percentage points;
* character-level Shakespeare (the char-rnn/nanoGPT task) with a small GPT and fewer steps;
  the metric is validation cross-entropy (nats per character).

Wang et al. (HPDC'20) report FFT compression at the accuracy of uncompressed training; our
target: the default FFT within 0.5 points of dense on Fashion-MNIST. Each record holds the
final metric, its delta to dense, the bytes vs dense, step times and the curve for the plot.

Codec labels (:mod:`.labels`): ``dense``; any hook spec (``fft``,
``powersgd:rank=4``, ``torch-fp16``, ``auto`` on SGD tasks); ``auto`` / ``auto:link=RATE`` on
Adam tasks choose dense AdamW or 1-bit Adam (:mod:`superneurons.optim.autoadam`; the record's
``decision`` holds the choice and its predictions); ``adam-momentum[warmup=N,wire=W]:SPEC`` and
``adam-update[...]:SPEC`` train with :class:`~superneurons.optim.adam.CompressedAdamW`; a
suffix ``|diminishing:start=S,floor=F,drops=D,until=U`` gives the hook a
:class:`~superneurons.codecs.schedule.DiminishingTheta` (HPDC'20's two θ claims);
``diloco[steps=H,...]:SPEC`` trains with DiLoCo (:mod:`superneurons.localsgd`: the task's
optimizer as the inner one, the last window closed at the last step, evaluated on the synced
model). ``curve_train_s``: rank 0's seconds since the start at each curve point, its
evaluations left out (time to a loss).
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from superneurons.bench.convergence.labels import (
    applies,
    check_label,
    scheme_of,
    split_label,
    theta_schedule,
)
from superneurons.errors import ConfigError
from superneurons.localsgd.diloco import LocalSGD, attach_local_sgd
from superneurons.schemes.adam import AdamAuto, AdamMomentum, AdamUpdate
from superneurons.schemes.diloco import DiLoCo
from superneurons.train.launch import free_port
from superneurons.train.rank import exit_rank, leave_process_group

__all__ = [
    "CONVERGENCE_CODECS",
    "ConvergenceConfig",
    "TaskConfig",
    "add_deltas",
    "run_convergence_bench",
]

log = logging.getLogger("superneurons.bench.convergence")

CONVERGENCE_CODECS: tuple[str, ...] = (
    "dense",
    "fft",
    "topk",
    "qsgd",
    "terngrad",
    "signsgd",
    "powersgd:rank=4",
    "torch-powersgd:rank=4",
    "adam-momentum[warmup=20,wire=fp16]:signsgd",
)
Progress = Callable[[str], None]


@dataclass(frozen=True)
class TaskConfig:
    """One training task: ``task`` is ``fashion-mnist`` or ``shakespeare``."""

    task: str
    model: str
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    steps: int = 0  # 0: whole epochs (``epochs``) over the training shard
    epochs: int = 1
    batch_size: int = 64  # per rank
    lr: float = 0.05
    optimizer: str = "sgd"  # "sgd" (momentum 0.9), "adam" or "adamw" (weight decay 0.01)
    train_limit: int = 0  # 0: the whole training set; else its first N samples
    eval_points: int = 8  # metric evaluations along the run (the curve), last = final
    eval_limit: int = 0  # 0: the whole test/val set for the final point

    def __post_init__(self) -> None:
        if self.task not in ("fashion-mnist", "shakespeare"):
            raise ConfigError(f"task must be fashion-mnist or shakespeare, got {self.task!r}")
        if self.optimizer not in ("sgd", "adam", "adamw"):
            raise ConfigError(f"optimizer must be sgd, adam or adamw, got {self.optimizer!r}")
        if self.steps < 0 or self.epochs < 1 or self.batch_size < 1 or self.eval_points < 1:
            raise ConfigError("steps >= 0, epochs >= 1, batch_size >= 1, eval_points >= 1")


FASHION_MNIST = TaskConfig("fashion-mnist", "mlp", epochs=2, batch_size=64, lr=0.05)
SHAKESPEARE = TaskConfig(
    "shakespeare",
    "gpt",
    {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
    steps=200,
    batch_size=16,
    lr=3e-3,
    optimizer="adamw",
    eval_points=5,
    eval_limit=256,
)


@dataclass(frozen=True)
class ConvergenceConfig:
    """Which codecs, on which tasks, with how many ranks."""

    codecs: tuple[str, ...] = CONVERGENCE_CODECS
    tasks: tuple[TaskConfig, ...] = (FASHION_MNIST, SHAKESPEARE)
    nproc: int = 2
    seed: int = 0
    fashion_mnist_root: str = "/usr/share/datasets/fashion-mnist"
    shakespeare_root: str = "data/shakespeare"
    timeout_s: float = 1800.0
    bandwidth_bit_s: int | None = None  # None: loopback; else a link shaped to this rate

    def __post_init__(self) -> None:
        if "dense" not in self.codecs:
            raise ConfigError("the convergence benchmark needs 'dense' as its reference codec")
        if self.nproc < 1:
            raise ConfigError(f"nproc must be >= 1, got {self.nproc}")
        for codec in self.codecs:
            check_label(codec)  # fail before any rank starts

    @staticmethod
    def quick() -> ConvergenceConfig:
        """Three codecs, one Fashion-MNIST epoch on 12k images, 60 Shakespeare steps."""
        return ConvergenceConfig(
            codecs=("dense", "fft", "topk"),
            tasks=(
                replace(FASHION_MNIST, epochs=1, train_limit=12_000, eval_points=4),
                replace(SHAKESPEARE, steps=60, eval_points=3),
            ),
        )


def _datasets(task: TaskConfig, config: ConvergenceConfig) -> tuple[Any, Any]:
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


def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: str) -> float:
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
    task: TaskConfig, codec: str, data: tuple[Any, Any], rank: int, world: int, seed: int
) -> dict[str, Any]:
    """Train ``task`` under ``codec`` on this rank's shard; returns the curve (rank 0 only)."""
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
    decision, scheme = None, scheme_of(task.optimizer, codec)
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
        )
        scheme = decision.scheme
    ddp = DistributedDataParallel(model)
    state, opt = _setup(ddp, task, codec, scheme, total, seed)
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
                curve.append([step, _evaluate(model, x_test[part], y_test[part], task.task)])
            eval_s += time.perf_counter() - eval_start_s
    wall_s, cpu_s = time.perf_counter() - start_s, time.process_time() - start_cpu_s
    dense_bytes = sum(4 * p.numel() for p in model.parameters() if p.requires_grad)
    sent = getattr(state, "bytes_sent_total", 0)
    return {
        "task": task.task,
        "model": task.model,
        "codec": codec,
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
    ddp: DistributedDataParallel, task: TaskConfig, label: str, scheme: Any, total: int, seed: int
) -> tuple[Any, torch.optim.Optimizer]:
    """The compression state (or None) and the optimizer for one codec label, whose spec
    names ``scheme`` (None: dense)."""
    from superneurons.optim.adam import CompressedAdamW

    schedule = split_label(label)[1]
    decay = 0.01 if task.optimizer == "adamw" else 0.0
    state: Any = None
    if isinstance(scheme, DiLoCo):  # the task's optimizer is the inner one
        state = attach_local_sgd(ddp, scheme, seed=seed)
    elif isinstance(scheme, AdamMomentum | AdamUpdate):
        if task.optimizer == "sgd":
            raise ConfigError(f"{label!r} replaces Adam/AdamW; task {task.task} uses SGD")
        from superneurons.ddp.local import register_local_gradients

        register_local_gradients(ddp)
        opt = CompressedAdamW(
            ddp.parameters(), lr=task.lr, weight_decay=decay, seed=seed, **scheme.kwargs()
        )
        return opt, opt
    elif scheme is not None:
        from superneurons.compress import Scheduled
        from superneurons.ddp.hook import register_compression
        from superneurons.schemes.compose import with_defaults

        if schedule is not None:
            scheme = Scheduled(scheme, theta_schedule(schedule, total))
        state = register_compression(ddp, with_defaults(scheme), seed=seed)
    if task.optimizer == "sgd":
        return state, torch.optim.SGD(ddp.parameters(), lr=task.lr, momentum=0.9)
    return state, torch.optim.AdamW(ddp.parameters(), lr=task.lr, weight_decay=decay)


def _rank_main(
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
            data = _datasets(task, config)
            for codec in (c for c in config.codecs if applies(task.optimizer, c)):
                record = _train_one(task, codec, data, rank, config.nproc, config.seed)
                if rank == 0:
                    with open(out, "a", encoding="utf-8") as handle:
                        handle.write(json.dumps(record) + "\n")
    except BaseException:
        leave_process_group(barrier=False)  # the spawner reports the traceback
        raise
    exit_rank(0)  # this function is the rank's whole process (spawned, or _shaped_rank)


def run_convergence_bench(
    config: ConvergenceConfig, *, progress: Progress | None = None
) -> list[dict[str, Any]]:
    """Train every (task, codec); returns records with ``delta_vs_dense`` filled in."""
    import torch.multiprocessing as mp

    say = progress or log.info
    expected = sum(applies(t.optimizer, c) for t in config.tasks for c in config.codecs)
    with tempfile.TemporaryDirectory(prefix="sn-convergence-") as tmp:
        out = Path(tmp) / "records.jsonl"
        seen = 0

        def poll() -> None:
            nonlocal seen
            lines = out.read_text().splitlines() if out.exists() else []
            for line in lines[seen:]:
                say(_describe(json.loads(line), len(lines), expected))
            seen = len(lines)

        if config.bandwidth_bit_s is not None:
            from superneurons.bench.convergence.shaped import run_ranks_shaped

            run_ranks_shaped(config, out, poll)
        else:
            ctx = mp.start_processes(
                _rank_main,
                args=(config, free_port(), str(out)),
                nprocs=config.nproc,
                join=False,
                start_method="spawn",
            )
            while not ctx.join(timeout=1.0):
                poll()
        poll()
        lines = out.read_text().splitlines() if out.exists() else []
        records = [json.loads(line) for line in lines]
    add_deltas(records)
    return records


def _describe(record: dict[str, Any], done: int, expected: int) -> str:
    return (
        f"[{done}/{expected}] {record['task']} {record['codec']}: {record['metric']} "
        f"{record['final_metric']:.3f} ({record['steps']} steps, {record['wall_s']:.0f} s)"
    )


def add_deltas(records: Sequence[dict[str, Any]]) -> None:
    """``delta_vs_dense`` = final metric - dense's final metric on the same task (points of
    accuracy, or nats of loss: lower loss is better)."""
    dense = {r["task"]: r["final_metric"] for r in records if r["codec"] == "dense"}
    for record in records:
        base = dense.get(record["task"])
        record["delta_vs_dense"] = None if base is None else record["final_metric"] - base


def _shaped_rank(argv: list[str]) -> None:
    """One rank over a shaped link (started by :mod:`.shaped` in its namespace)."""
    config_path, rank, port, out, master_addr, ifname = argv
    config = pickle.loads(Path(config_path).read_bytes())  # noqa: S301 - our own file
    _rank_main(int(rank), config, int(port), out, master_addr=master_addr, ifname=ifname)


if __name__ == "__main__":
    _shaped_rank(sys.argv[1:])
