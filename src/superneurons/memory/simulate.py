"""Simulate zoo models on fake tensors: profiles without memory, and the largest depth / batch.

:func:`profile_zoo` builds a zoo model, its optimizer and a batch under ``FakeTensorMode`` (fake
*cpu* tensors; byte sizes are device independent) and profiles one step. Nothing is allocated,
so a 12 GiB step costs only the Python time of its ops (~0.1 ms each).

:func:`max_fitting` finds the largest depth (the ``[6, 32, n, 6]`` ResNet family of SuperNeurons,
Wang et al., PPoPP'18 §4) or batch whose smallest predicted peak under a strategy fits a budget,
without profiling every candidate: every middle block of stage 3 is identical (same shapes, same
ops), so once stage 3 holds the peak the strategy's minimal peak is *affine* in n; likewise
activations are affine in the batch. It profiles three sizes, fits the line through the two
largest, reports the third's residual, and solves for the largest fitting size. Callers validate
against a direct profile at the answer where they can afford it (``verify=True`` for batches).
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory.plan import Plan
from superneurons.memory.planner import CostModel, min_peak_bytes
from superneurons.memory.profile import profile_step
from superneurons.memory.profile_types import Profile

__all__ = [
    "OPTIMIZERS",
    "FitResult",
    "max_fitting",
    "profile_zoo",
    "simulate_plan",
    "zoo_peaks",
]

logger = logging.getLogger("superneurons.memory")

# NOTE: literal table; SGD momentum 0.9 is the SuperNeurons/ResNet training recipe.
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "none": lambda params: torch.optim.SGD(params, lr=0.1),
}


def profile_zoo(
    name: str, *, batch_size: int, optimizer: str = "sgd", **model_kwargs: Any
) -> Profile:
    """Profile one step of zoo model ``name`` on fake tensors (no real memory)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from superneurons.models.zoo import build_model, default_loss, model_input

    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    mode = FakeTensorMode()
    with mode:
        model = build_model(name, **model_kwargs)
        opt = None if optimizer == "none" else OPTIMIZERS[optimizer](model.parameters())
        inputs, targets = model_input(name, batch_size, **model_kwargs)
    return profile_step(model, inputs, targets, default_loss(name), opt, fake_mode=mode)


@dataclass(frozen=True)
class FitResult:
    """The largest size that fits, and how it was found.

    Attributes:
        strategy: planner strategy.
        size: largest depth-family ``n`` or batch whose predicted peak fits (0: none fits).
        intercept_bytes / slope_bytes: the fitted ``peak = intercept + slope * size``.
        samples: ``(size, peak_bytes)`` of the profiled sizes.
        residual: relative error of the fit at the smallest sample.
        seconds: wall time of the search.
        verified: the size was checked (and corrected) by direct profiles.
    """

    strategy: str
    size: int
    intercept_bytes: float
    slope_bytes: float
    samples: tuple[tuple[int, int], ...]
    residual: float
    seconds: float
    verified: bool = False


def max_fitting(
    peaks: Callable[[int], dict[str, int]],
    strategies: tuple[str, ...],
    *,
    budget_bytes: int,
    sizes: tuple[int, int, int],
    progress: Callable[[str], None] | None = None,
    verify: bool = False,
) -> dict[str, FitResult]:
    """Largest size per strategy with ``peaks(size)[strategy] <= budget_bytes`` (affine fit).

    ``peaks(size)`` returns each strategy's smallest predicted peak at ``size`` (e.g.
    ``min_peak_bytes(profile_zoo(...))``); it is called once per sample size. With ``verify``
    the fitted answer is then checked by direct calls (``size`` fits, ``size + 1`` does not)
    and corrected by a bracketing search where the peak is not affine (``verified=True``).
    """
    if budget_bytes <= 0:
        raise ConfigError(f"budget must be positive, got {budget_bytes}")
    start_s = time.perf_counter()
    small, mid, large = sorted(sizes)
    samples: dict[int, dict[str, int]] = {}

    def peak(size: int, strategy: str) -> int:
        if size not in samples:
            t0 = time.perf_counter()
            samples[size] = peaks(size)
            if progress is not None:
                progress(f"profiled size {size} in {time.perf_counter() - t0:.1f} s")
        return samples[size][strategy]

    for size in (small, mid, large):
        peak(size, strategies[0])
    results = {}
    for strategy in strategies:
        y_mid, y_large = samples[mid][strategy], samples[large][strategy]
        slope = (y_large - y_mid) / (large - mid)
        intercept = y_large - slope * large
        fit_small = intercept + slope * small
        residual = abs(fit_small - samples[small][strategy]) / max(samples[small][strategy], 1)
        if slope <= 0:
            size = large if y_large <= budget_bytes else 0
        else:
            size = max(int(math.floor((budget_bytes - intercept) / slope)), 0)
        if verify:
            size = _bracket(functools.partial(_fits, peak, strategy, budget_bytes), max(size, 1))
        results[strategy] = FitResult(
            strategy=strategy,
            size=size,
            intercept_bytes=intercept,
            slope_bytes=slope,
            samples=tuple((s, samples[s][strategy]) for s in (small, mid, large)),
            residual=residual,
            seconds=time.perf_counter() - start_s,
            verified=verify,
        )
    return results


def _fits(peak: Callable[[int, str], int], strategy: str, budget_bytes: int, size: int) -> bool:
    return peak(size, strategy) <= budget_bytes


def _bracket(fits: Callable[[int], bool], guess: int) -> int:
    """Largest ``n >= 1`` with ``fits(n)`` (0 if none), searching outward from ``guess``;
    assumes ``fits`` is monotone (a larger model or batch never needs less memory)."""
    if fits(guess):
        low, step = guess, 1
        while fits(low + step):
            low, step = low + step, step * 2
        high = low + step  # fails
    else:
        high, step = guess, 1
        while True:
            candidate = high - step
            if candidate < 1:
                if high == 1 or not fits(1):
                    return 0
                low = 1
                break
            if fits(candidate):
                low = candidate
                break
            high, step = candidate, step * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def zoo_peaks(
    name: str, axis: str, *, cost: CostModel | None = None, **fixed: Any
) -> Callable[[int], dict[str, int]]:
    """``f(size)`` -> each strategy's smallest peak; ``axis`` is ``"n"`` (stage-3 blocks of the
    ``[6, 32, n, 6]`` ResNet) or ``"batch"``; ``fixed`` holds the other :func:`profile_zoo`
    arguments (``batch_size`` for ``"n"``)."""
    if axis not in ("n", "batch"):
        raise ConfigError(f"axis must be 'n' or 'batch', got {axis!r}")

    def peaks(size: int) -> dict[str, int]:
        kwargs = dict(fixed)
        if axis == "n":
            kwargs["layers"] = (6, 32, size, 6)
        else:
            kwargs["batch_size"] = size
        return min_peak_bytes(profile_zoo(name, **kwargs), cost=cost)

    return peaks


class _StepAll:
    """Stands in for the optimizer when each parameter steps in backward: holds their state."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.state = {k: v for opt in optimizers for k, v in opt.state.items()}

    def step(self) -> None:  # the per-parameter optimizers already stepped in backward
        return None


def simulate_plan(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    plan: Plan,
) -> Profile:
    """Execute ``plan`` on fake copies and measure it (``measured_peak_bytes``, steady state).

    Recompute units run under non-reentrant ``torch.utils.checkpoint`` (segments nested in one
    outer checkpoint); offload units pack saved tensors to ``meta`` (no device bytes) and restore
    them when backward unpacks them, i.e. later than the runtime's one-unit-ahead prefetch, so the
    simulated peak is a lower bound of the runtime's. One warm-up step runs first so optimizer
    state is resident, as from the second step on.
    """
    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode

    mode = FakeTensorMode()
    with FakeCopyMode(mode):
        model, optimizer = copy.deepcopy((model, optimizer))
    inputs, targets = (mode.from_tensor(t) if torch.is_tensor(t) else t for t in (inputs, targets))
    with mode:
        _apply(model, plan)
        per_param = _in_backward(model, optimizer) if plan.optimizer_in_backward else []
        loss_fn(model(inputs), targets).backward()  # warm-up: optimizer state exists after it
        if not per_param:
            optimizer.step()
        for p in model.parameters():
            p.grad = None
        stepper: Any = _StepAll(per_param) if per_param else optimizer
    return profile_step(model, inputs, targets, loss_fn, stepper, fake_mode=mode, units=[])


def _in_backward(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    optimizers = []
    for param in model.parameters():
        opt = type(optimizer)([param], **optimizer.defaults)

        def step(_p: torch.Tensor, opt: torch.optim.Optimizer = opt) -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        param.register_post_accumulate_grad_hook(step)
        optimizers.append(opt)
    return optimizers


class _Offloader:
    """Simulated host pool: saved tensors go to ``meta``; when backward first needs a unit, it
    and the unit before it (if also offloaded: the runtime's one-ahead prefetch) come back."""

    def __init__(self, model: nn.Module, plan: Plan) -> None:
        self.params = {int(p.untyped_storage()._cdata) for p in model.parameters()}
        order = [u.fqn for u in plan.units]
        offloaded = {u.fqn for u in plan.units if u.action == "offload"}
        self.previous = {
            b: a
            for a, b in zip(order, order[1:], strict=False)
            if a in offloaded and b in offloaded
        }
        self.slots: dict[str, list[list[Any]]] = {}
        self.by_storage: dict[int, tuple[Any, Any, Any]] = {}

    def wrap(self, fqn: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        def pack(tensor: torch.Tensor) -> Any:
            if int(tensor.untyped_storage()._cdata) in self.params:
                return tensor
            storage = tensor.untyped_storage()
            known = self.by_storage.get(int(storage._cdata))
            if known is not None and known[0]() is storage and known[2] == tensor.shape:
                return known[1]  # the same storage saved twice is offloaded once
            slot = [tensor.to("meta"), tensor.device, None]
            self.slots.setdefault(fqn, []).append(slot)
            self.by_storage[int(storage._cdata)] = (weakref.ref(storage), (fqn, slot), tensor.shape)
            return (fqn, slot)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            unit, slot = packed
            self.by_storage.clear()  # backward has begun: no more packs to deduplicate
            for name in (unit, self.previous.get(unit)):
                for other in self.slots.pop(name or "", []):
                    other[2] = torch.empty_like(other[0], device=other[1])
            if slot[2] is None:  # a storage saved twice: its second unpack
                slot[2] = torch.empty_like(slot[0], device=slot[1])
            return slot[2]

        def run(*args: Any, **kwargs: Any) -> Any:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return forward(*args, **kwargs)

        return run


def _apply(model: nn.Module, plan: Plan) -> None:
    offloader = _Offloader(model, plan)
    segments: dict[int, list[str]] = {}
    for unit in plan.units:
        module = model.get_submodule(unit.fqn)
        if unit.action == "recompute":
            module.forward = _checkpointed(module.forward)  # type: ignore[method-assign]
        elif unit.action == "offload":
            module.forward = offloader.wrap(unit.fqn, module.forward)  # type: ignore[method-assign]
        if unit.segment >= 0:
            segments.setdefault(unit.segment, []).append(unit.fqn)
    for fqns in segments.values():
        parent_fqn = fqns[0].rpartition(".")[0]
        parent = model.get_submodule(parent_fqn)
        names = [f.rpartition(".")[2] for f in fqns]
        _segment_sequential(parent, names)  # type: ignore[arg-type]


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    from torch.utils.checkpoint import checkpoint

    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def _segment_sequential(parent: nn.Sequential, names: list[str]) -> None:
    """Make ``parent`` run children ``names`` (consecutive) under one outer checkpoint."""
    previous = parent.forward
    segments = getattr(parent, "_sn_segments", [])
    segments.append(names)
    parent._sn_segments = segments  # type: ignore[assignment]

    def forward(x: Any) -> Any:
        children = list(parent.named_children())
        index = 0
        while index < len(children):
            name, child = children[index]
            group = next((g for g in parent._sn_segments if g[0] == name), None)  # type: ignore[union-attr]
            if group is None:
                x = child(x)
                index += 1
                continue
            chunk = [m for _, m in children[index : index + len(group)]]

            def run(inp: Any, chunk: list[nn.Module] = chunk) -> Any:
                for module in chunk:
                    inp = module(inp)
                return inp

            x = _checkpointed(run)(x)
            index += len(group)
        return x

    del previous
    parent.forward = forward  # type: ignore[method-assign]
