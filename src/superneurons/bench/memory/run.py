"""The memory benchmark: device peak and step time of one training step, ours vs the anchors.

For one model and batch every method runs the same step (gradients reset to ``None``, forward,
loss, backward with the output alive, as :mod:`superneurons.train.loop` runs it, optimizer step)
and is measured by :mod:`superneurons.bench.memory.meter` (CUDA: ``max_memory_allocated`` and
CUDA events; CPU: the live-storage count and wall/CPU time). Budgets are fractions of eager's
measured peak. Methods: ``eager``; ``ours`` (``make_plan`` at each budget, executed by
:func:`~superneurons.memory.runtime.apply.apply_plan`) and ``ours-offload`` (``strategy="offload"``);
the anchors of :mod:`superneurons.bench.memory.anchors`, all in the same run.

On CUDA the profile runs on real CUDA tensors and the bytes the allocator holds beyond live
tensors (cuDNN/cuBLAS workspaces, rounding: :func:`~superneurons.memory.profiling.workspace.
untracked_peak_bytes` of the eager step) are set aside from each budget before planning; the
predicted device peak is the plan's prediction plus them. ``cap_workspace`` also caps the
allocator at the budget while our plan runs (:func:`~superneurons.memory.profiling.workspace.
limit_workspace`), so convolutions get the workspace the plan leaves.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from superneurons.bench.memory.anchors import (
    ANCHORS,
    activation_memory_budget,
    checkpointed_units,
    compile_unavailable,
    save_on_cpu,
)
from superneurons.bench.memory.meter import StepMeasure, device_peak_bytes, measure_step
from superneurons.errors import ConfigError
from superneurons.memory.profiling.workspace import (
    cudnn_settings,
    limit_workspace,
    untracked_peak_bytes,
)
from superneurons.memory.runtime.apply import apply_plan
from superneurons.memory.runtime.stateful import kv_cache_off
from superneurons.models.zoo import build_model, default_loss, model_input

__all__ = ["METHODS", "MODELS", "MemoryBenchConfig", "device_peak_bytes", "run_memory_bench"]

logger = logging.getLogger("superneurons.bench")

METHODS: tuple[str, ...] = ("eager", "ours", "ours-offload", *ANCHORS)
# resnet50: the zoo's; gpt: the zoo's char GPT; gpt2: the zoo GPT at GPT-2 small's shape;
# hf-gpt2: transformers' GPT2LMHeadModel with its default config (use_cache=True included).
MODELS: tuple[str, ...] = ("resnet50", "gpt", "gpt2", "hf-gpt2")
_TINY_GPT2 = {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 256}
_TINY_RESNET50 = {"width": 16, "num_classes": 10}


@dataclass(frozen=True)
class MemoryBenchConfig:
    """What to measure.

    Attributes:
        budgets: fractions of eager's measured peak for our plans.
        compile_budgets: ``activation_memory_budget`` values swept by the compile anchor.
        tiny: the models at a tiny size (CPU runs, tests): GPT-2 at 2 layers of width 64,
            ResNet-50 at base width 16 (its 50 layers and in-place ReLUs) with 10 classes.
        optimizer_in_backward: let the planner step parameters in backward (the anchors
            cannot, and DDP must not: off by default).
        cap_workspace: cap the CUDA allocator at the budget while our plans run.
    """

    model: str = "resnet50"
    device: str = "cpu"
    batch_size: int = 32
    budgets: tuple[float, ...] = (0.75, 0.5, 0.35, 0.25)
    compile_budgets: tuple[float, ...] = (1.0, 0.5, 0.25, 0.1, 0.0)
    image_size: int = 112
    block_size: int = 256
    steps: int = 3
    methods: tuple[str, ...] = METHODS
    tiny: bool = False
    optimizer_in_backward: bool = False
    cap_workspace: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"unknown model {self.model!r}: choose from {', '.join(MODELS)}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device here; use --device cpu")
        if self.batch_size < 1 or self.steps < 1:
            raise ConfigError("batch_size and steps must be >= 1")
        if not self.budgets or any(not 0.0 < b <= 1.0 for b in self.budgets):
            raise ConfigError(f"budgets must be fractions in (0, 1], got {self.budgets}")
        if any(not 0.0 <= b <= 1.0 for b in self.compile_budgets):
            raise ConfigError(f"compile budgets must be in [0, 1], got {self.compile_budgets}")
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            raise ConfigError(f"unknown methods {unknown}: choose from {', '.join(METHODS)}")


class _Workload:
    """Model, optimizer, batch and loss of the benchmark, and the training step over them."""

    def __init__(self, config: MemoryBenchConfig) -> None:
        torch.manual_seed(config.seed)
        self.device = torch.device(config.device)
        self.is_cnn = config.model == "resnet50"
        self.model, self.inputs, self.targets, self.loss_fn = _build(config)
        self.model.to(self.device).train()
        self.inputs, self.targets = self.inputs.to(self.device), self.targets.to(self.device)
        params = list(self.model.parameters())
        self.optimizer = self.make_optimizer(params)
        # Optimizers whose state counts as resident; with optimizer-in-backward the runtime's
        # per-parameter optimizers replace ``optimizer`` and the step does not call it.
        self.live_optimizers: list[torch.optim.Optimizer] = [self.optimizer]
        self.forward: Callable[[Any], Any] = self.model

    def make_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if self.is_cnn:  # the paper's settings: SGD-momentum for ResNets, AdamW for GPTs
            return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-4)

    def step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        output = self.forward(self.inputs)
        loss = self.loss_fn(output, self.targets)
        loss.backward()
        # NOTE: the output lives through backward, as in train/loop.py and profile_step. A step
        # that drops it first holds B*T*V*4 bytes of logits less: for GPT-2 124M at B=8, T=1024
        # that is 1.53 GiB, close to the 1.50 GiB gap between an earlier H100 profile (11.89 GiB)
        # and the eager peak it was compared with (10.39 GiB), which made 50% look infeasible.
        del output, loss
        if self.optimizer in self.live_optimizers:
            self.optimizer.step()

    def resident(self) -> list[torch.Tensor]:
        state = [
            t
            for opt in self.live_optimizers
            for s in opt.state.values()
            for t in s.values()
            if torch.is_tensor(t)
        ]
        return [*self.model.parameters(), *self.model.buffers(), *state, self.inputs, self.targets]

    def measure(self, steps: int, host: Callable[[], Any] = tuple) -> StepMeasure:
        return measure_step(
            self.step, device=self.device, steps=steps, resident=self.resident, host=host
        )


def _build(config: MemoryBenchConfig) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Any]:
    if config.model == "hf-gpt2":
        return _hf_gpt2(config)
    kwargs: dict[str, Any] = {}
    name = config.model
    if name == "resnet50":
        kwargs = {"image_size": config.image_size}
        if config.tiny:  # ResNet-50's blocks and in-place ReLUs, 1/16 of its parameters
            kwargs.update(_TINY_RESNET50)
    elif name == "gpt":
        kwargs = {"block_size": config.block_size}
    else:  # gpt2: the zoo GPT at GPT-2 small's shape (or tiny)
        name = "gpt"
        kwargs = {"preset": "gpt2", "block_size": config.block_size}
        if config.tiny:
            kwargs.update(_TINY_GPT2)
    build_kwargs = {k: v for k, v in kwargs.items() if k != "image_size"}
    model = build_model(name, **build_kwargs)
    inputs, targets = model_input(name, config.batch_size, **kwargs)
    return model, inputs, targets, default_loss(name)


def _hf_gpt2(config: MemoryBenchConfig) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Any]:
    try:
        from transformers.models.gpt2 import GPT2Config, GPT2LMHeadModel
    except ImportError as exc:
        raise ConfigError("--model hf-gpt2 needs transformers: pip install transformers") from exc
    shape: dict[str, Any] = {"n_positions": max(config.block_size, 1024)}
    if config.tiny:
        shape.update(_TINY_GPT2, bos_token_id=0, eos_token_id=0)
    hf_config = GPT2Config(**shape)  # HF defaults otherwise: use_cache=True
    model = GPT2LMHeadModel(hf_config)
    gen = torch.Generator().manual_seed(config.seed)
    size = (config.batch_size, config.block_size)
    inputs = torch.randint(0, hf_config.vocab_size, size, generator=gen)
    targets = torch.randint(0, hf_config.vocab_size, size, generator=gen)
    return model, inputs, targets, _hf_lm_loss


def _hf_lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def copy_bandwidth_bytes_per_s(device: torch.device, nbytes: int = 64 << 20) -> float:
    """Measured device->host copy bandwidth (pinned on CUDA; on CPU a memcpy into the slab),
    so the planner weighs offload against recompute with this machine's figures."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst.copy_(src)
    best_s = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)  # a device->pageable-or-pinned copy returns when it is done
        best_s = min(best_s, time.perf_counter() - start)
    return nbytes / best_s


def _ours(
    work: _Workload,
    config: MemoryBenchConfig,
    eager_peak: int,
    *,
    strategy: str,
    profile: Any,
    workspace_bytes: int,
) -> list[dict[str, Any]]:
    from superneurons.memory.plan import ACTIONS, InfeasibleBudgetError
    from superneurons.memory.planner.decide import make_plan

    bandwidth = copy_bandwidth_bytes_per_s(work.device)
    rows: list[dict[str, Any]] = []
    for fraction in config.budgets:
        budget = int(eager_peak * fraction)
        row: dict[str, Any] = {"budget_fraction": fraction, "budget_bytes": budget}
        try:
            plan = make_plan(
                profile,
                budget_bytes=budget - workspace_bytes,
                strategy=strategy,
                bandwidth_bytes_per_s=bandwidth,
                allow_optimizer_in_backward=config.optimizer_in_backward,
                # the anchors keep the loop's optimizer on the device: so do our plans here
                # (benchmarks/below_largest_layer.py measures the host optimizer)
                allow_host_optimizer=False,
            )
        except InfeasibleBudgetError as exc:
            floor = (exc.min_budget_bytes + workspace_bytes) / eager_peak
            rows.append({**row, "skipped": f"infeasible: planner floor {floor:.3f}x eager"})
            continue
        factory = work.make_optimizer if plan.optimizer_in_backward else None
        handle = apply_plan(work.model, plan, optimizer_factory=factory)
        cap = None
        try:
            if config.cap_workspace:  # convolution workspaces get what the plan leaves
                cap = limit_workspace(cap_bytes=budget, device=work.device)
            if plan.optimizer_in_backward:
                work.live_optimizers = list(handle.optimizers.values())
            row.update(work.measure(config.steps, host=handle.pool.host_buffers).as_record())
            row["host_bytes"] = handle.pool.stats().peak_host_bytes
        except torch.OutOfMemoryError as exc:
            row["skipped"] = f"out of memory under the allocator cap: {str(exc)[:120]}"
        finally:
            if cap is not None:
                cap.remove()
            handle.remove()
            work.live_optimizers = [work.optimizer]
        predicted = plan.predicted_peak_bytes + workspace_bytes
        row.update(
            strategy=plan.strategy,
            copy_bytes_per_s=bandwidth,
            predicted_peak_bytes=predicted,
            predicted_tensor_bytes=plan.predicted_peak_bytes,
            workspace_bytes=workspace_bytes,
            actions={a: plan.count(a) for a in ACTIONS},
            optimizer_in_backward=plan.optimizer_in_backward,
        )
        rows.append(row)
    return rows


def _compile(work: _Workload, config: MemoryBenchConfig) -> list[dict[str, Any]]:
    reason = compile_unavailable(work.device)
    if reason is not None:
        return [{"skipped": reason}]
    rows: list[dict[str, Any]] = []
    for fraction in config.compile_budgets:
        row: dict[str, Any] = {"compile_budget": fraction}
        try:
            with activation_memory_budget(fraction):
                torch._dynamo.reset()
                work.forward = torch.compile(work.model)
                start = time.perf_counter()
                work.step()  # compiles forward and backward
                row["compile_s"] = time.perf_counter() - start
                row.update(work.measure(config.steps).as_record())
        except Exception as exc:  # noqa: BLE001 - a compile failure is recorded, not fatal
            row["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            logger.warning("torch.compile at budget %s skipped: %s", fraction, row["skipped"])
        finally:
            work.forward = work.model
            torch._dynamo.reset()
        if work.device.type == "cpu" and "peak_bytes" in row:
            # NOTE: ``peak_bytes`` is the c10 CPU allocator's (memory_meter), which sees what
            # inductor's generated code allocates. The dispatch-level live count does not: a
            # compiled step under its dispatch mode falls back to eager (measured: exactly
            # eager's peak at every budget), so that figure is dropped.
            row["tracked_peak_bytes"] = None
            row["peak_note"] = "c10 allocator view; the live-storage count cannot see inductor"
        rows.append(row)
    return rows


def _anchor(work: _Workload, method: str, units: list[str], steps: int) -> StepMeasure:
    if method == "save_on_cpu":
        with save_on_cpu(work.device):
            return work.measure(steps)
    with checkpointed_units(work.model, units, selective=method == "selective"):
        return work.measure(steps)


@contextlib.contextmanager
def _no_kv_cache(model: nn.Module) -> Iterator[None]:
    """HF models run the anchors with ``use_cache=False``, as HF's own gradient checkpointing
    does (and as ours do): a recompute would write the key/value cache twice (selective
    checkpointing refuses it outright) and the cache keeps activations on the device."""
    handles = kv_cache_off(model)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def run_memory_bench(config: MemoryBenchConfig) -> list[dict[str, Any]]:
    """Measure every method of ``config`` in one run; one record per (method, point)."""
    from superneurons.memory.profile_types import default_units
    from superneurons.memory.profiling.step import profile_step

    work = _Workload(config)
    units = default_units(work.model)
    eager = work.measure(config.steps).as_record()
    workspace = untracked_peak_bytes(work.step, resident=work.resident(), device=work.device)
    eager_peak = int(eager["peak_bytes"] or 0)
    records: list[dict[str, Any]] = [
        {"method": "eager", "budget_fraction": 1.0, **eager, "workspace_bytes": workspace}
    ]
    logger.info("eager: peak %d bytes, %.4f s/step", eager_peak, eager["step_s"])
    profile = None
    for method in config.methods:
        _release(work.device)
        if method in ("ours", "ours-offload"):
            if profile is None:  # profile_step copies (model, optimizer): ours stay untouched
                profile = profile_step(
                    work.model, work.inputs, work.targets, work.loss_fn, work.optimizer
                )
            strategy = "auto" if method == "ours" else "offload"
            rows = _ours(
                work, config, eager_peak, strategy=strategy, profile=profile,
                workspace_bytes=workspace,
            )  # fmt: skip
        elif method == "compile":
            with _no_kv_cache(work.model):
                rows = _compile(work, config)
        elif method in ANCHORS:
            with _no_kv_cache(work.model):
                rows = [_anchor(work, method, units, config.steps).as_record()]
        else:
            continue
        records += [{"method": method, "budget_fraction": None, **row} for row in rows]
    for record in records:
        record.update(model=config.model, batch_size=config.batch_size, units=len(units))
        record.setdefault("budget_fraction", None)
        if record.get("peak_bytes") is not None:
            record["peak_fraction"] = record["peak_bytes"] / eager_peak
        if record.get("step_s") is not None:
            record["step_ratio_vs_eager"] = record["step_s"] / eager["step_s"]
        if record.get("step_cpu_s") is not None and eager.get("step_cpu_s"):
            record["cpu_ratio_vs_eager"] = record["step_cpu_s"] / eager["step_cpu_s"]
    return records


def bench_context(config: MemoryBenchConfig) -> dict[str, Any]:
    """The config and the cuDNN/allocator settings, for the JSON record."""
    return {"config": asdict(config), "cudnn": cudnn_settings()}


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
