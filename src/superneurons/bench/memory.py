"""The memory benchmark: device peak and step time of one training step, ours vs the baselines.

For one zoo model and batch, every method runs the same step (forward, loss, backward, optimizer
step, gradients reset to ``None`` first) and is measured twice:

* **peak**: a dispatch-level live-storage count (:class:`~superneurons.memory.tracker.
  LiveStorageTracker`) of one steady-state step, the same accounting the planner's profile uses.
  Host memory is not device memory: the tensor pool's slab is subtracted, and the
  ``save_on_cpu`` baseline's host copies are made outside the count, so on a CPU build the figure
  is what a GPU would hold (CONTEXT.md §1);
* **time**: the median wall time of ``steps`` untracked steps (one thread).

Methods: ``eager``; ``ours`` (``make_plan`` at each budget, a fraction of eager's measured peak,
with the measured copy bandwidth, executed by :func:`~superneurons.memory.runtime.apply_plan`);
``ours-offload`` (the same with ``strategy="offload"``); ``checkpoint`` (plain non-reentrant
``torch.utils.checkpoint`` around every unit, Chen et al. 2016); ``selective`` (per unit,
``create_selective_checkpoint_contexts`` saving conv/matmul/attention outputs, recomputing the
rest, as Megatron-style selective recompute); ``save_on_cpu`` (``torch.autograd.graph.save_on_cpu``
semantics: every saved tensor, weights included, copied to the host in forward and back on
demand); ``compile`` (``torch.compile`` with ``torch._functorch.config.
activation_memory_budget`` at each budget: step time only, see :func:`_compile`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from superneurons.errors import ConfigError
from superneurons.memory.runtime import apply_plan
from superneurons.memory.tracker import LiveStorageTracker
from superneurons.models.zoo import build_model, default_loss, model_input

__all__ = ["MemoryBenchConfig", "device_peak_bytes", "run_memory_bench"]

logger = logging.getLogger("superneurons.bench")

METHODS: tuple[str, ...] = (
    "eager",
    "ours",
    "ours-offload",
    "checkpoint",
    "selective",
    "save_on_cpu",
    "compile",
)


@dataclass(frozen=True)
class MemoryBenchConfig:
    """What to measure. ``budgets`` are fractions of eager's measured peak (1.0 = 100%)."""

    model: str = "resnet50"
    batch_size: int = 32
    budgets: tuple[float, ...] = (1.0, 0.5, 0.25, 0.1)
    image_size: int = 112
    block_size: int = 256
    steps: int = 3
    methods: tuple[str, ...] = METHODS
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.steps < 1:
            raise ConfigError("batch_size and steps must be >= 1")
        if not self.budgets or any(not 0.0 < b <= 1.0 for b in self.budgets):
            raise ConfigError(f"budgets must be fractions in (0, 1], got {self.budgets}")
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            raise ConfigError(f"unknown methods {unknown}: choose from {', '.join(METHODS)}")

    def model_kwargs(self) -> dict[str, Any]:
        if self.model in ("gpt", "lstm"):
            return {"block_size": self.block_size}
        return {"image_size": self.image_size}


StepFn = Callable[[], None]


def device_peak_bytes(
    step: StepFn, *, resident: Sequence[torch.Tensor], host: Sequence[torch.Tensor] = ()
) -> int:
    """Live-storage peak of ``step()`` on top of ``resident`` tensors, ``host`` buffers excluded.

    ``host`` (e.g. ``handle.pool.host_buffers()``) is registered first and subtracted: pinned
    host memory is not device memory.
    """
    tracker = LiveStorageTracker()
    host_bytes = tracker.register(host)
    tracker.register(resident)
    with tracker:
        step()
    return int(tracker.peak_bytes - host_bytes)


def _median_step_s(step: StepFn, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _Workload:
    """Model, optimizer, batch and loss of the benchmark, and the training step over them."""

    def __init__(self, config: MemoryBenchConfig) -> None:
        torch.manual_seed(config.seed)
        kwargs = config.model_kwargs()
        build_kwargs = {k: v for k, v in kwargs.items() if k != "image_size"}
        self.model = build_model(config.model, **build_kwargs)
        self.inputs, self.targets = model_input(config.model, config.batch_size, **kwargs)
        self.loss_fn = default_loss(config.model)
        self.optimizer = self.make_optimizer(list(self.model.parameters()))
        # Optimizers whose state counts as resident; with optimizer-in-backward the runtime's
        # per-parameter optimizers replace ``optimizer`` and the step does not call it.
        self.live_optimizers: list[torch.optim.Optimizer] = [self.optimizer]
        self.forward: Callable[[torch.Tensor], torch.Tensor] = self.model

    @staticmethod
    def make_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)

    def step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.forward(self.inputs), self.targets)
        loss.backward()
        del loss
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

    def measure(self, steps: int, host: Callable[[], Sequence[torch.Tensor]] = tuple) -> dict:
        self.step()  # warm-up: optimizer state exists, the pool's slab has its size
        peak = device_peak_bytes(self.step, resident=self.resident(), host=host())
        return {"peak_bytes": peak, "step_s": _median_step_s(self.step, steps)}


@contextlib.contextmanager
def _wrapped_units(model: nn.Module, units: Sequence[str], wrap: Callable) -> Iterator[None]:
    """Temporarily replace each unit's forward by ``wrap(forward)`` (instance attribute)."""
    modules = [model.get_submodule(u) for u in units]
    for module in modules:
        module.forward = wrap(module.forward)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module in modules:
            del module.forward


def _checkpointed(forward: Callable, context_fn: Callable | None = None) -> Callable:
    from torch.utils.checkpoint import checkpoint, noop_context_fn

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(
            forward, *args, use_reentrant=False, context_fn=context_fn or noop_context_fn, **kwargs
        )

    return run


def _selective_context() -> Any:
    """Save conv / matmul / attention outputs, recompute everything else."""
    from superneurons.compat import selective_checkpoint_contexts

    aten = torch.ops.aten
    heavy = {aten.convolution.default, aten.mm.default, aten.addmm.default, aten.bmm.default}
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_attention_math",
    ):
        if hasattr(aten, name):
            heavy.add(getattr(aten, name).default)

    return selective_checkpoint_contexts(lambda op: op in heavy)


@contextlib.contextmanager
def _save_on_cpu_semantics() -> Iterator[None]:
    """``torch.autograd.graph.save_on_cpu`` as a GPU runs it: every saved tensor is copied to the
    host in forward (outside the device count) and copied back on unpack (inside it)."""

    def pack(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        with _disable_current_modes():
            return tensor.device, tensor.detach().clone()  # the device->host copy

    def unpack(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, host = packed
        return host.clone().to(device)  # the host->device copy, a new device tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def copy_bandwidth_bytes_per_s(nbytes: int = 64 << 20) -> float:
    """Measured device->host copy bandwidth (on a CPU build: a memcpy into the slab), so the
    planner weighs offload against recompute with this machine's figures, not a GPU's."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    if torch.cuda.is_available():
        src, dst = src.cuda(), dst.pin_memory()
    dst.copy_(src)
    best_s = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # timing only, outside any step
        best_s = min(best_s, time.perf_counter() - start)
    return nbytes / best_s


def _ours(
    work: _Workload, config: MemoryBenchConfig, eager_peak: int, *, strategy: str, profile: Any
) -> list[dict]:
    from superneurons.memory.plan import InfeasibleBudgetError
    from superneurons.memory.planner import make_plan

    bandwidth = copy_bandwidth_bytes_per_s()
    rows = []
    for fraction in config.budgets:
        budget = int(eager_peak * fraction)
        try:
            plan = make_plan(
                profile, budget_bytes=budget, strategy=strategy, bandwidth_bytes_per_s=bandwidth
            )
        except InfeasibleBudgetError as exc:
            floor = exc.min_budget_bytes / eager_peak
            note = f"infeasible: planner minimum {floor:.2f}x eager ({exc.strategy})"
            rows.append({"budget_fraction": fraction, "skipped": note})
            continue
        factory = work.make_optimizer if plan.optimizer_in_backward else None
        with apply_plan(work.model, plan, optimizer_factory=factory) as handle:
            if plan.optimizer_in_backward:
                work.live_optimizers = list(handle.optimizers.values())
            try:
                row = work.measure(config.steps, host=handle.pool.host_buffers)
            finally:
                work.live_optimizers = [work.optimizer]
            row["host_bytes"] = handle.pool.stats().peak_host_bytes
        row.update(
            budget_fraction=fraction,
            budget_bytes=budget,
            strategy=plan.strategy,
            copy_bytes_per_s=bandwidth,
            predicted_peak_bytes=plan.predicted_peak_bytes,
            actions={a: plan.count(a) for a in ("keep", "offload", "recompute")},
            optimizer_in_backward=plan.optimizer_in_backward,
        )
        rows.append(row)
    return rows


def _compile(work: _Workload, config: MemoryBenchConfig) -> list[dict]:
    import torch._functorch.config as functorch_config

    rows = []
    for fraction in config.budgets:
        row: dict[str, Any] = {"budget_fraction": fraction, "peak_bytes": None}
        # NOTE: the peak is not measured: inductor's CPU kernels allocate through
        # empty_strided_cpu, below the dispatcher, and a compiled step run under an active
        # dispatch mode falls back to eager (measured here: exactly eager's peak at every
        # budget with the aot_eager_decomp_partition backend). Step time only.
        row["peak_note"] = "not measurable on CPU: inductor allocates below the dispatcher"
        try:
            with functorch_config.patch(activation_memory_budget=fraction):
                torch._dynamo.reset()
                work.forward = torch.compile(work.model)
                start = time.perf_counter()
                work.step()
                row["compile_s"] = time.perf_counter() - start
                row["step_s"] = _median_step_s(work.step, config.steps)
        except Exception as exc:  # noqa: BLE001 - any compile failure is recorded, not fatal
            row["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            logger.warning("torch.compile at budget %s skipped: %s", fraction, row["skipped"])
        finally:
            work.forward = work.model
            torch._dynamo.reset()
        rows.append(row)
    return rows


def run_memory_bench(config: MemoryBenchConfig) -> list[dict[str, Any]]:
    """Measure every method of ``config``; one record per (method, budget) point."""
    from superneurons.memory.profile_types import default_units

    work = _Workload(config)
    units = default_units(work.model)
    eager = work.measure(config.steps)
    records: list[dict[str, Any]] = [{"method": "eager", "budget_fraction": 1.0, **eager}]
    logger.info("eager: peak %d bytes, %.3f s/step", eager["peak_bytes"], eager["step_s"])
    profile = None
    for method in config.methods:
        if method in ("ours", "ours-offload"):
            if profile is None:  # profile_step copies (model, optimizer): ours stay untouched
                from superneurons.memory.profile import profile_step

                profile = profile_step(
                    work.model, work.inputs, work.targets, work.loss_fn, work.optimizer
                )
            strategy = "auto" if method == "ours" else "offload"
            rows = _ours(work, config, eager["peak_bytes"], strategy=strategy, profile=profile)
        elif method == "compile":
            rows = _compile(work, config)
        elif method == "checkpoint":
            with _wrapped_units(work.model, units, _checkpointed):
                rows = [work.measure(config.steps)]
        elif method == "selective":
            wrap = functools.partial(_checkpointed, context_fn=_selective_context)
            with _wrapped_units(work.model, units, wrap):
                rows = [work.measure(config.steps)]
        elif method == "save_on_cpu":
            with _save_on_cpu_semantics():
                rows = [work.measure(config.steps)]
        else:
            continue
        for row in rows:
            records.append({"method": method, "budget_fraction": None, **row})
    for record in records:
        record["model"] = config.model
        record["batch_size"] = config.batch_size
        record["units"] = len(units)
        if record.get("peak_bytes") is not None:
            record["peak_fraction"] = record["peak_bytes"] / eager["peak_bytes"]
        if record.get("step_s") is not None:
            record["step_ratio_vs_eager"] = record["step_s"] / eager["step_s"]
    return records
