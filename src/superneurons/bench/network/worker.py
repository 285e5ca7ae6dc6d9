"""One rank of the network benchmark: real data-parallel training steps under each codec.

Started by :mod:`superneurons.bench.network.run` as ``python -m superneurons.bench.network.worker
CONFIG_JSON`` inside the rank's network namespace (or on loopback). Each rank runs one thread
(``torch.set_num_threads(1)``: with a second busy process, torch's default threads made small
ops 30-50x slower here), joins a gloo group over the shaped link, and:

1. times ``compute_steps`` local forward/backward/optimizer steps with no communication (the
   compute-only reference, both ranks computing at once as they do under DDP);
2. for each codec in turn (one process start and one gloo rendezvous for all of them), builds
   the model afresh with the same weights, wraps it in DDP, registers the codec's comm hook
   and times ``steps`` training steps after ``warmup_steps`` untimed ones (DDP rebuilds its
   buckets after the first step, and PyTorch's PowerSGD runs dense for its first iterations).

Rank 0 appends one JSON line per finished codec to ``out``, so a crash or hang in one codec
loses nothing measured before it (the parent restarts the ranks for the codecs after it). Bytes per step come from the hook's counter where
the hook keeps one, otherwise from the analytic volume of a ring all-reduce (stated in the
record's ``bytes_source``). Inside a network namespace every rank also reads its own
interface's byte counters (``/proc/net/dev``, which shows the namespace's interfaces) around
the timed steps: ``bytes_received_per_rank`` is what the wire delivered to a rank per step
(the mean over ranks; payload plus TCP/IP headers), measured, not computed from sizes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from superneurons.bench.links.wire_bytes import interface_bytes, wire_bytes_per_rank
from superneurons.errors import ConfigError
from superneurons.schemes.anchors import TorchDense, TorchFp16, TorchPowerSGD
from superneurons.schemes.grammar import Compression, parse_spec
from superneurons.train.rank import exit_rank, leave_process_group

__all__ = ["WorkerConfig", "analytic_bytes_per_step", "main", "run_worker"]

log = logging.getLogger("superneurons.bench.network")


@dataclass(frozen=True)
class WorkerConfig:
    """What one rank runs; serialised to JSON on the worker's command line."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    model: str
    codecs: tuple[str, ...]
    batch_size: int = 32
    warmup_steps: int = 2
    steps: int = 5
    compute_steps: int = 3
    seed: int = 0
    lr: float = 0.01
    timeout_s: float = 600.0
    out: str = ""
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    # "real": Fashion-MNIST where the model takes it (see network_data); "random": noise
    data: str = "random"
    data_root: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} outside world size {self.world_size}")
        if self.steps < 1 or self.warmup_steps < 0 or self.compute_steps < 0:
            raise ConfigError("steps must be >= 1, warmup_steps and compute_steps >= 0")
        if not self.codecs:
            raise ConfigError("give at least one codec")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        self.compressions  # noqa: B018  (parses every label now, before joining the group)

    @cached_property
    def compressions(self) -> dict[str, Compression]:
        """Each codec label parsed once in this rank's process (records keep the label)."""
        return {label: parse_spec(label) for label in self.codecs}


def _build_model(config: WorkerConfig) -> nn.Module:
    """The model from the shared zoo, with the same initial weights on every rank."""
    from superneurons.models import build_model

    torch.manual_seed(config.seed)
    return build_model(config.model, **config.model_kwargs)


def _batches(
    config: WorkerConfig, model: nn.Module
) -> tuple[Iterator[tuple[torch.Tensor, torch.Tensor]], str]:
    """This rank's batch stream and what it is (``"real"`` or ``"random"``, see network_data)."""
    from superneurons.bench.network.data import bench_batches

    return bench_batches(
        model,
        config.model,
        config.model_kwargs,
        data=config.data,
        root=config.data_root,
        batch_size=config.batch_size,
        seed=config.seed,
        rank=config.rank,
        world_size=config.world_size,
    )


def _timed_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    count: int,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    sync: Callable[[], None],
    each: list[tuple[float, float]] | None = None,
) -> tuple[float, float, float]:
    """Run ``count`` steps; returns (mean wall seconds per step, mean CPU seconds per step of
    this process, all its threads, last loss). CPU time excludes waiting for the network and
    for other processes: on a shared machine it is what the step would cost on an idle core.
    ``each`` (if given) receives every step's (wall, CPU) seconds: one disturbed step among
    three moves a mean by a third of its excess."""
    if count == 0:
        return math.nan, math.nan, math.nan
    sync()
    start_s, start_cpu_s = time.perf_counter(), time.process_time()
    loss = torch.zeros(())
    last_s, last_cpu_s = start_s, start_cpu_s
    for _ in range(count):
        x, y = next(batches)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        if each is not None:
            now_s, now_cpu_s = time.perf_counter(), time.process_time()
            each.append((now_s - last_s, now_cpu_s - last_cpu_s))
            last_s, last_cpu_s = now_s, now_cpu_s
    sync()
    cpu_s = (time.process_time() - start_cpu_s) / count
    return (time.perf_counter() - start_s) / count, cpu_s, float(loss.item())


def analytic_bytes_per_step(model: nn.Module, compression: Compression, world_size: int) -> float:
    """Bytes one rank sends per step under a ring all-reduce: ``2 (P-1)/P`` times the payload.

    dense: fp32 gradients; torch-fp16: fp16; torch-powersgd:rank=r: P and Q factors (fp32) of
    every matrix PyTorch compresses (it views a tensor as ``(shape[0], -1)`` and compresses when
    ``n m >= 2 r (n + m)``), plus the rest uncompressed.
    """
    ring = 2 * (world_size - 1) / world_size
    grads = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in grads)
    if isinstance(compression, TorchDense):
        return ring * 4 * numel
    if isinstance(compression, TorchFp16):
        return ring * 2 * numel
    if isinstance(compression, TorchPowerSGD):
        rank = compression.rank
        elements = 0
        for p in grads:
            n = p.shape[0]
            m = p.numel() // max(n, 1)
            compress = p.dim() >= 2 and n * m >= 2 * rank * (n + m)
            elements += rank * (n + m) if compress else p.numel()
        return ring * 4 * elements
    raise ConfigError(f"no analytic byte count for codec {compression.spec!r}")


def _register(ddp: DistributedDataParallel, compression: Compression) -> Any:
    """Register ``compression``'s comm hook (with error feedback by default, as for a spec
    string); returns the hook state, or None for plain DDP (``dense``: no hook at all)."""
    from superneurons.ddp.hook import register_compression
    from superneurons.schemes.compose import with_defaults

    if isinstance(compression, TorchDense):
        return None
    return register_compression(ddp, with_defaults(compression))


def _bytes_counter(state: Any) -> int | None:
    """The hook state's cumulative bytes-sent counter, if it keeps one."""
    for attr in ("bytes_sent_total", "bytes_sent"):
        value = getattr(state, attr, None)
        if isinstance(value, int | float):
            return int(value)
    return None


def run_worker(config: WorkerConfig) -> None:
    """Run this rank: join the group, measure every codec, leave the group."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{config.master_addr}:{config.master_port}",
        rank=config.rank,
        world_size=config.world_size,
        timeout=timedelta(seconds=config.timeout_s),
    )
    finished = False
    try:
        _run(config)
        finished = True
    finally:  # NOTE: no barrier after a failure: a peer may never arrive
        leave_process_group(barrier=finished)


def _run(config: WorkerConfig) -> None:
    from superneurons.models import default_loss

    loss_fn = default_loss(config.model)
    model = _build_model(config)
    batches, data = _batches(config, model)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    local_opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
    no_sync: Callable[[], None] = lambda: None  # noqa: E731
    _timed_steps(model, local_opt, batches, 1, loss_fn=loss_fn, sync=no_sync)  # first-call costs
    compute_s, compute_cpu_s, _ = _timed_steps(
        model, local_opt, batches, config.compute_steps, loss_fn=loss_fn, sync=dist.barrier
    )
    for codec in config.codecs:
        record = _run_codec(config, codec, batches, loss_fn)
        if config.rank == 0 and config.out:
            record.update(
                nproc=config.world_size,
                params=numel,
                compute_step_s=compute_s,
                compute_cpu_s=compute_cpu_s,
                data=data,
            )
            with open(config.out, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")


def _bucket_cap_mb(model: nn.Module, compression: Compression) -> int | None:
    """DDP's default buckets (25 MiB, None), except one bucket for PyTorch's PowerSGD hook.

    NOTE: torch's ``powerSGD_hook`` issues collectives from future callbacks; with several
    buckets on gloo that crashed 2 of 3 runs of a small model and every run of the 30M
    parameter fc-heavy model here (``gloo::EnforceNotMet`` in pair.cc). One bucket is the
    only configuration in which the anchor runs at all; it loses overlap with backward.
    """
    if not isinstance(compression, TorchPowerSGD):
        return None
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return total_bytes // 2**20 + 1


def _run_codec(
    config: WorkerConfig,
    codec: str,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> dict[str, Any]:
    compression = config.compressions[codec]
    model = _build_model(config)  # fresh weights: every codec starts from the same point
    bucket_cap_mb = _bucket_cap_mb(model, compression)
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    state = _register(ddp, compression)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=config.lr, momentum=0.9)
    with torch.no_grad():
        x, y = next(batches)
        first_loss = float(loss_fn(model(x), y).item())
    no_sync: Callable[[], None] = lambda: None  # noqa: E731
    auto = getattr(state, "auto", None)
    # NOTE: auto observes dense steps, then decides: time it once it has decided.
    warmup = (
        max(config.warmup_steps, auto.decide_step + 1) if auto is not None else config.warmup_steps
    )
    _timed_steps(ddp, optimizer, batches, warmup, loss_fn=loss_fn, sync=no_sync)
    before = _bytes_counter(state)
    profile_dir = os.environ.get("SUPERNEURONS_NET_PROFILE", "")
    profiler = None
    if profile_dir and config.rank == 0:  # opt-in diagnosis: cProfile of rank 0's timed steps
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    each: list[tuple[float, float]] = []
    wire_before = interface_bytes(os.environ.get("GLOO_SOCKET_IFNAME", ""))  # this namespace's
    step_s, cpu_s, last_loss = _timed_steps(
        ddp, optimizer, batches, config.steps, loss_fn=loss_fn, sync=dist.barrier, each=each
    )
    wire = wire_bytes_per_rank(wire_before, config.steps)
    if profiler is not None:
        profiler.disable()
        name = f"{config.model}-{codec}-{time.time_ns()}.prof".replace(":", "_")
        profiler.dump_stats(os.path.join(profile_dir, name))
    after = _bytes_counter(state)
    if before is not None and after is not None:
        bytes_per_step, source = (after - before) / config.steps, "hook counter"
    else:
        bytes_per_step = analytic_bytes_per_step(model, compression, config.world_size)
        source = "analytic ring all-reduce"
    return {
        "model": config.model,
        "codec": codec,
        "batch_size": config.batch_size,
        "warmup_steps": warmup,
        "steps": config.steps,
        "mean_step_s": step_s,
        "cpu_step_s": cpu_s,
        "step_s_each": [round(wall, 4) for wall, _ in each],
        "cpu_step_s_each": [round(cpu, 4) for _, cpu in each],
        "bytes_per_step": bytes_per_step,
        "bytes_source": source,
        **wire,
        "ddp_bucket_cap_mb": bucket_cap_mb or 25,
        "first_loss": first_loss,
        "last_loss": last_loss,
        **(_auto_fields(state) if auto is not None else {}),
    }


def _auto_fields(state: Any) -> dict[str, Any]:
    """``auto``'s decision and, on rank 0 (which measured them), the inputs it was made from:
    the report replays them at other world sizes and link rates (``strategy.decide_at``)."""
    inputs = state.auto.inputs
    return {
        "sync_assignment": state.summary()["sync_assignment"],
        "sync_inputs": inputs.to_dict() if inputs is not None else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m superneurons.bench.network.worker CONFIG_JSON")
    raw = json.loads(args[0])
    config = WorkerConfig(**{**raw, "codecs": tuple(raw.get("codecs", ()))})
    logging.basicConfig(level=os.environ.get("SUPERNEURONS_LOG", "WARNING"))
    run_worker(config)
    return 0


if __name__ == "__main__":
    main()
    exit_rank(0)  # an error above exits 1 with its traceback; see exit_rank for why
