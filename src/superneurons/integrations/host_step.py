"""The optimizer on the host inside a trainer's own loop: what
:func:`~superneurons.integrations.accelerate.prepare_superneurons` installs besides the plan
when the plan steps the optimizer on the host (``offload+host-optimizer``).

* the loop's optimizer is handed over (:mod:`superneurons.memory.offload.handover`): its
  ``step()`` runs the host's, its ``zero_grad()`` drops what waits on the host, the LR
  scheduler's values reach the host's parameter groups;
* under DDP, the wrapper Trainer or ``accelerator.prepare`` built before any plan existed is
  rebuilt in place to hold no gradient buckets and attached to the host optimizer's own
  (:mod:`superneurons.memory.offload.rewrap`); DDP's ``no_sync`` (Trainer's and
  ``accelerator.accumulate``'s micro-batches) keeps the all-reduce for the last one;
* without DDP, ``accelerator.sync_gradients`` says which backward is the last of its
  micro-batches (Trainer sets it before each one);
* ``accelerator.clip_grad_norm_`` over the planned model's parameters (Trainer's call, and an
  Accelerate loop's) clips the gradients waiting on the host by their global norm and returns
  it, so what Trainer logs as ``grad_norm`` is the true norm; where the plan steps in backward
  (no clipping, no accumulation) it returns the norm of the last backward.

Every change is entered in the set-up's undo stack.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from superneurons.errors import ConfigError
from superneurons.memory.offload.handover import hand_over
from superneurons.memory.plan import TrainingStep

__all__ = ["HOST_OPTIMIZER", "host_reserved_bytes", "install_host_step", "training_step_of"]

HOST_OPTIMIZER = "offload+host-optimizer"


def training_step_of(
    accelerator: Any, max_grad_norm: float, gradient_accumulation_steps: int | None
) -> TrainingStep | None:
    """The loop's clipping and accumulation (accumulation: the accelerator's where not given;
    Trainer keeps its own and passes it); None for neither."""
    steps = gradient_accumulation_steps
    if steps is None:
        steps = int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1)
    step = TrainingStep(max_grad_norm=float(max_grad_norm or 0.0), accumulation_steps=steps)
    return None if step == TrainingStep() else step


def host_reserved_bytes(ddp: DistributedDataParallel) -> int:
    """What DDP holds beside the planned step once rebuilt for the host optimizer: the one
    parameter it still manages (the smallest), its bucket and its gradient (as
    :func:`~superneurons.integrations.accelerate.ddp_reserved_bytes` counts a DDP's)."""
    trainable = [p for p in ddp.module.parameters() if p.requires_grad]
    smallest = min((p.numel() * p.element_size() for p in trainable), default=0)
    return smallest if ddp.gradient_as_bucket_view else 2 * smallest


def install_host_step(
    undo: ExitStack,
    accelerator: Any,
    ddp: DistributedDataParallel | None,
    handle: Any,
    optimizer: Any,
) -> None:
    """Hand the loop's ``optimizer`` to ``handle``'s host optimizer, attach it to ``ddp`` (or
    to the accelerator's ``sync_gradients``) and route the accelerator's clipping to it
    (module docstring); every change entered in ``undo``."""
    if getattr(accelerator, "scaler", None) is not None:
        raise ConfigError(
            "fp16 loss scaling (a GradScaler) with the optimizer on the host is not supported: "
            "train in bf16 (or fp32), or give a budget that fits without the host optimizer"
        )
    view, buckets = handle.optimizer, handle.buckets
    if ddp is not None:
        handle.attach(ddp, rebuild=True)  # handle.remove() rebuilds it as it was
    elif hasattr(accelerator, "sync_gradients"):
        buckets.sync = lambda: bool(accelerator.sync_gradients)
    undo.callback(hand_over(optimizer, handle).remove)
    if hasattr(accelerator, "clip_grad_norm_"):
        _route_clipping(undo, accelerator, handle.model, view)


def _route_clipping(undo: ExitStack, accelerator: Any, model: nn.Module, view: Any) -> None:
    """``accelerator.clip_grad_norm_`` over ``model``'s trainable parameters clips on the host;
    over other parameters it is the accelerator's own."""
    own = accelerator.clip_grad_norm_
    planned = {id(p) for p in model.parameters() if p.requires_grad}

    def clip_grad_norm_(parameters: Iterable[Any], max_norm: float, norm_type: float = 2) -> Any:
        params = list(parameters) if not isinstance(parameters, torch.Tensor) else [parameters]
        ours = {id(p) for p in params if p.requires_grad} & planned
        if not ours:
            return own(params, max_norm, norm_type)
        if ours != planned:
            raise ConfigError(
                "clip the planned model's parameters all at once: their gradients wait on the "
                "host, where the global norm is taken over all of them"
            )
        return view.clip_grad_norm_(max_norm, norm_type, params)

    accelerator.clip_grad_norm_ = clip_grad_norm_
    undo.callback(accelerator.__dict__.pop, "clip_grad_norm_", None)
