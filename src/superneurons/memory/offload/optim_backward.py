"""Optimizer-in-backward: step each parameter as soon as its gradient is accumulated.

``Tensor.register_post_accumulate_grad_hook`` runs a one-parameter optimizer and frees the
gradient at once, so gradients never accumulate (the PyTorch tutorial "How to save memory by
fusing the optimizer step into the backward pass"). With ``host_state`` the optimizer state
lives in the host pool between the parameters' steps
(:mod:`superneurons.memory.offload.optim_host`; the planner's model of it is
:func:`superneurons.memory.planner.predict_steps.host_state_timeline`).

A loop that clips by the global norm or accumulates micro-batches
(:class:`~superneurons.memory.plan.TrainingStep` ``waits``) cannot step a parameter when its
gradient arrives: :class:`WaitingSteps` lets the gradients stay in ``.grad`` and, when the last
micro-batch's backward ends, clips them by their global norm (``clip_grad_norm_``'s arithmetic:
:func:`~superneurons.memory.offload.host_grads.clip_grad_norm_`) and steps each parameter in
the order its hook fired, freeing its gradient after its step. Every gradient then lives to
the end of backward: the planner counts it
(:func:`~superneurons.memory.planner.predict_steps.step_in_backward`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from superneurons.memory.offload.host_grads import clip_grad_norm_
from superneurons.memory.offload.optim_host import HostOptimizerState
from superneurons.memory.plan import TrainingStep

__all__ = ["WaitingSteps", "register_optimizer_in_backward"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def register_optimizer_in_backward(
    model: nn.Module,
    factory: OptimizerFactory,
    *,
    host_state: HostOptimizerState | None = None,
    step: TrainingStep | None = None,
) -> tuple[dict[str, torch.optim.Optimizer], list[Any]]:
    """One optimizer per trainable parameter of ``model``, stepped in its gradient's hook.

    Returns ``(optimizers by parameter fqn, hook handles)``; remove the handles to stop. With
    ``host_state`` each optimizer's state is kept in the host pool and brought to the device
    for the parameter's step only. With a ``step`` that clips or accumulates, the last handle
    is a :class:`WaitingSteps` (the steps wait for the end of the last micro-batch).
    """
    optimizers: dict[str, torch.optim.Optimizer] = {}
    hooks: list[Any] = []
    waiting = WaitingSteps(model, step) if step is not None and step.waits else None
    for fqn, param in model.named_parameters():
        if not param.requires_grad:
            continue
        optimizer = factory([param])
        optimizers[fqn] = optimizer
        if host_state is not None:
            host_state.manage(param, optimizer)

        def step_now(p: torch.Tensor, opt: torch.optim.Optimizer = optimizer) -> None:
            if host_state is not None:
                host_state.before_step(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if host_state is not None:
                host_state.after_step(p)

        hook = waiting.hook(step_now) if waiting is not None else step_now
        hooks.append(param.register_post_accumulate_grad_hook(hook))
    if waiting is not None:
        hooks.append(waiting)
    return optimizers, hooks


class WaitingSteps:
    """The steps of optimizer-in-backward held until the last micro-batch's backward ends,
    then clipped by the global norm and run in hook order (module docstring).

    Attributes:
        sync: says whether the backward running is the last of its micro-batches (e.g.
            ``lambda: accelerator.sync_gradients``); None: every ``accumulation_steps``-th.
        grad_norm: the total norm the last step was clipped by (None before, or without
            clipping).
    """

    def __init__(self, model: nn.Module, step: TrainingStep) -> None:
        self.model = model
        self.step = step
        self.sync: Callable[[], bool] | None = None
        self.grad_norm: torch.Tensor | None = None
        self.backwards = 0  # backward passes since the last step
        self._order: list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]] = []
        self._queued = False

    def hook(self, step_now: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        """The post-accumulate hook that, instead of stepping, remembers the step."""

        def remember(param: torch.Tensor) -> None:
            if not self._queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
                self._queued = True
            self._order.append((param, step_now))

        return remember

    def _end_of_backward(self) -> None:
        self._queued = False
        self.backwards += 1
        last = self.backwards % self.step.accumulation_steps == 0
        if self.sync is not None:
            last = bool(self.sync())
        if not last:
            self._order.clear()  # the gradients accumulate in .grad until the last one
            return
        order, self._order, self.backwards = self._order, [], 0
        if self.step.clips:
            params = [p for p in self.model.parameters() if p.grad is not None]
            self.grad_norm = clip_grad_norm_(params, self.step.max_grad_norm, self.step.norm_type)
        seen: set[int] = set()
        for param, step_now in order:
            if id(param) not in seen and param.grad is not None:
                seen.add(id(param))
                step_now(param)

    def remove(self) -> None:
        self._order.clear()
