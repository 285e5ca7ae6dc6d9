"""Optimizer-in-backward: step each parameter as soon as its gradient is accumulated.

``Tensor.register_post_accumulate_grad_hook`` runs a one-parameter optimizer and frees the
gradient at once, so gradients never accumulate (the PyTorch tutorial "How to save memory by
fusing the optimizer step into the backward pass"). With ``host_state`` the optimizer state
lives in the host pool between the parameters' steps
(:mod:`superneurons.memory.offload.optim_host`).

The planner's model of the latter is
:func:`superneurons.memory.planner.predict_steps.host_state_timeline`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from superneurons.memory.offload.optim_host import HostOptimizerState

__all__ = ["register_optimizer_in_backward"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def register_optimizer_in_backward(
    model: nn.Module,
    factory: OptimizerFactory,
    *,
    host_state: HostOptimizerState | None = None,
) -> tuple[dict[str, torch.optim.Optimizer], list[Any]]:
    """One optimizer per trainable parameter of ``model``, stepped in its gradient's hook.

    Returns ``(optimizers by parameter fqn, hook handles)``; remove the handles to stop. With
    ``host_state`` each optimizer's state is kept in the host pool and brought to the device
    for the parameter's step only.
    """
    optimizers: dict[str, torch.optim.Optimizer] = {}
    hooks: list[Any] = []
    for fqn, param in model.named_parameters():
        if not param.requires_grad:
            continue
        optimizer = factory([param])
        optimizers[fqn] = optimizer
        if host_state is not None:
            host_state.manage(param, optimizer)

        def step(p: torch.Tensor, opt: torch.optim.Optimizer = optimizer) -> None:
            if host_state is not None:
                host_state.before_step(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if host_state is not None:
                host_state.after_step(p)

        hooks.append(param.register_post_accumulate_grad_hook(step))
    return optimizers, hooks
