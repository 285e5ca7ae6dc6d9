"""Simulate on fake tensors: profile zoo models and execute plans without using memory.

:func:`profile_zoo` builds a zoo model, its optimizer and a batch under ``FakeTensorMode`` (fake
*cpu* tensors; byte sizes are device independent) and profiles one step. Nothing is allocated,
so a 12 GiB step costs only the Python time of its ops (~0.1 ms each).

:func:`simulate_plan` executes a plan on fake copies with the runtime itself
(:func:`superneurons.memory.runtime.apply.apply_plan`: the same checkpoint wrappers, segments and
Unified Tensor Pool, prefetch included), with the pool's host copies on ``meta`` so that the
live-storage tracker counts exactly the device bytes. One executor, two kinds of tensors.
The zoo searches (largest depth / batch) live in :mod:`superneurons.memory.sizing.search`.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory.offload.pool import PoolConfig
from superneurons.memory.plan import Plan
from superneurons.memory.planner.bounds import split_largest
from superneurons.memory.profile_types import GRANULARITIES, Profile, default_units, layer_units
from superneurons.memory.profiling.step import profile_step
from superneurons.memory.runtime.apply import PlanHandle, apply_plan

__all__ = ["OPTIMIZERS", "profile_zoo", "simulate_plan"]

logger = logging.getLogger("superneurons.memory")

# NOTE: literal table; SGD momentum 0.9 is the SuperNeurons/ResNet training recipe.
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "none": lambda params: torch.optim.SGD(params, lr=0.1),
}


def profile_zoo(
    name: str,
    *,
    batch_size: int,
    optimizer: str = "sgd",
    granularity: str = "split",
    **model_kwargs: Any,
) -> Profile:
    """Profile one step of zoo model ``name`` on fake tensors (no real memory).

    ``granularity``: ``"block"`` (:func:`default_units`), ``"layer"`` (:func:`layer_units`) or
    ``"split"`` (blocks, then the blocks with the largest working sets split into their layers
    and profiled again: :func:`superneurons.memory.planner.bounds.split_largest`).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from superneurons.models.zoo import build_model, default_loss, model_input

    if granularity not in GRANULARITIES:
        raise ConfigError(
            f"unknown granularity {granularity!r}: use one of {', '.join(GRANULARITIES)}"
        )
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    mode = FakeTensorMode()
    with mode:
        model = build_model(name, **model_kwargs)
        opt = None if optimizer == "none" else OPTIMIZERS[optimizer](model.parameters())
        inputs, targets = model_input(name, batch_size, **model_kwargs)
    units = layer_units(model) if granularity == "layer" else default_units(model)
    loss_fn = default_loss(name)
    profile = profile_step(model, inputs, targets, loss_fn, opt, fake_mode=mode, units=units)
    if granularity == "split":
        split = split_largest(model, profile)
        if split != units:
            profile = profile_step(
                model, inputs, targets, loss_fn, opt, fake_mode=mode, units=split
            )
    return profile


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
    *,
    pool_config: PoolConfig | None = None,
) -> Profile:
    """Execute ``plan`` with :func:`apply_plan` on fake copies and measure it (steady state).

    ``measured_peak_bytes`` of the returned profile is the live-storage peak of the planned step.
    The pool runs as on a device (same packing, eviction and one-ahead prefetch) with its host
    copies on ``meta`` (``pool_config.host_device`` is forced to ``"meta"``). One warm-up step
    runs first so optimizer state is resident, as from the second step on.
    """
    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode

    base = pool_config or PoolConfig(host_bytes=plan.host_bytes)
    config = PoolConfig(**{**base.__dict__, "host_device": "meta"})
    mode = FakeTensorMode()
    with FakeCopyMode(mode):
        model, optimizer = copy.deepcopy((model, optimizer))
    inputs, targets = (mode.from_tensor(t) if torch.is_tensor(t) else t for t in (inputs, targets))
    with mode:

        def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
            accepted = inspect.signature(type(optimizer)).parameters
            options = {k: v for k, v in optimizer.defaults.items() if k in accepted}
            return type(optimizer)(params, **options)

        in_backward = plan.optimizer_in_backward or plan.host_optimizer
        handle: PlanHandle = apply_plan(
            model,
            plan,
            device=torch.device("cpu"),
            pool_config=config,
            optimizer_factory=factory if in_backward else None,
        )
        with handle:
            loss_fn(model(inputs), targets).backward()  # warm-up: optimizer state exists after it
            if not in_backward:
                optimizer.step()
            for p in model.parameters():
                p.grad = None
            per_param = list(handle.optimizers.values())
            stepper: Any = _StepAll(per_param) if per_param else optimizer
            if handle.optimizer is not None:  # the host optimizer: nothing on the device
                stepper = handle.optimizer
            return profile_step(model, inputs, targets, loss_fn, stepper, fake_mode=mode, units=[])
