"""Where a plan runs the optimizer, attached by
:func:`~superneurons.memory.runtime.apply.apply_plan`.

* ``plan.optimizer_in_backward``: one optimizer per parameter, stepped in its gradient's hook
  on the device (:mod:`.optim_backward`), its state in the host pool between steps with
  ``plan.optimizer_on_host`` (:mod:`.optim_host`); where ``plan.step`` clips or accumulates,
  the steps wait for the end of the last micro-batch (:class:`.optim_backward.WaitingSteps`);
* ``plan.host_optimizer``: the optimizer on the host, stepped per gradient bucket
  (:mod:`.host_buckets`, :mod:`.host_optimizer`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory.offload.host_buckets import install_host_optimizer
from superneurons.memory.offload.host_optimizer import HostOptimizerView
from superneurons.memory.offload.optim_backward import WaitingSteps, register_optimizer_in_backward
from superneurons.memory.offload.optim_host import HostOptimizerState

__all__ = ["attach_optimizer"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def attach_optimizer(handle: Any, model: nn.Module, factory: OptimizerFactory | None) -> None:
    """Run ``handle.plan``'s optimizer placement on ``model``; ``handle`` is the
    :class:`~superneurons.memory.runtime.apply.PlanHandle` whose hooks and optimizers it fills."""
    if handle.plan.host_optimizer:
        _on_host(handle, model, factory)
    elif handle.plan.optimizer_in_backward:
        _in_backward(handle, model, factory)


def _in_backward(handle: Any, model: nn.Module, factory: OptimizerFactory | None) -> None:
    """Step each parameter as soon as its gradient is accumulated, then free the gradient
    (:mod:`superneurons.memory.offload.optim_backward`); with ``plan.optimizer_on_host`` the state
    lives in the host pool between steps (:mod:`superneurons.memory.offload.optim_host`)."""
    if factory is None:
        raise ConfigError(
            "plan.optimizer_in_backward needs optimizer_factory=, e.g. "
            "lambda params: torch.optim.SGD(params, lr=0.1)"
        )
    if handle.plan.optimizer_on_host:
        handle.host_state = HostOptimizerState(
            device=handle.pool.device,
            host_device=handle.pool.config.host_device,
            capacity_bytes=handle.plan.optimizer_host_bytes,
            streams=handle.pool.copy_streams,
        )
    optimizers, hooks = register_optimizer_in_backward(
        model, factory, host_state=handle.host_state, step=handle.plan.step
    )
    handle.optimizers.update(optimizers)
    handle._hooks += hooks
    if hooks and isinstance(hooks[-1], WaitingSteps):  # clipping or accumulation
        handle.waiting_steps = hooks[-1]


def _on_host(handle: Any, model: nn.Module, factory: OptimizerFactory | None) -> None:
    """The optimizer on the host, stepped bucket by bucket in backward (module docstring)."""
    if factory is None:
        raise ConfigError(
            "plan.host_optimizer needs optimizer_factory=, e.g. "
            "lambda params: torch.optim.AdamW(params, lr=1e-4)"
        )
    host_device = handle.pool.config.host_device
    handle.buckets = install_host_optimizer(
        model, handle.plan.grad_buckets, factory, host_device=host_device, step=handle.plan.step
    )
    handle.optimizer = HostOptimizerView(handle.buckets.optimizer, handle.buckets)
    handle._hooks.append(handle.buckets)
