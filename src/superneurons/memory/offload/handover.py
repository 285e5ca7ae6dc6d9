"""A training loop's own optimizer handed over to a plan's host optimizer.

A plan with ``host_optimizer`` (strategy ``offload+host-optimizer``) steps the optimizer on the
host, bucket by bucket during backward (:mod:`.host_buckets`), and no gradient is left on the
device when backward ends. Where the loop already holds an optimizer (a
``transformers.Trainer``, an Accelerate loop), that optimizer stays the loop's:

* :func:`factory_like` builds the host optimizer like it: the same class, the same parameter
  groups (each parameter's fp32 host master in its place), the same hyperparameters;
* :func:`hand_over` makes the host optimizer take the loop optimizer's hyperparameters before
  every bucket's step (so the loop's learning-rate scheduler acts on it), moves state the loop
  optimizer already holds (a resumed checkpoint) to the host, and after the loop's
  ``optimizer.step()`` (which finds no gradient, so changes nothing) runs the host's step where
  the loop clips or accumulates (the gradients waiting on the host) and waits for the copies
  back to the device (CUDA), through PyTorch's ``Optimizer.register_step_post_hook``; the
  loop's ``optimizer.zero_grad()`` also drops the gradients waiting on the host.

The loop optimizer's ``state_dict()`` then holds its hyperparameters and no state; the host
optimizer's state (fp32 masters, moments) is ``PlanHandle.state_dict()["host_optimizer"]``,
which the integrations save beside the loop's checkpoint.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory.offload.host_optimizer import IMPLEMENTATION_KEYS, OptimizerFactory

__all__ = ["Handover", "factory_like", "hand_over", "inner_optimizer"]

logger = logging.getLogger("superneurons.memory")


def factory_like(optimizer: Any, model: nn.Module) -> OptimizerFactory:
    """An ``optimizer_factory`` for ``apply_plan`` that builds ``optimizer``'s class with its
    parameter groups and hyperparameters over the host masters of ``model``'s trainable
    parameters (handed in the order of ``model.named_parameters()``).

    Raises:
        ConfigError: ``optimizer`` is not a torch optimizer (nor wraps one), or steps tensors
            that are not trainable parameters of ``model``.
    """
    loop = _torch_optimizer(optimizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    position = {id(p): i for i, p in enumerate(trainable)}
    foreign = sum(
        1
        for g in loop.param_groups
        for p in g["params"]
        if p.requires_grad and id(p) not in position
    )
    if foreign:
        raise ConfigError(
            f"the optimizer steps {foreign} tensors that are not trainable parameters of "
            f"{type(model).__name__}: build it over the planned model's parameters"
        )
    cls = type(loop)
    accepted = inspect.signature(cls).parameters
    defaults = {
        k: v for k, v in loop.defaults.items() if k in accepted and k not in IMPLEMENTATION_KEYS
    }
    groups = [
        (
            [position[id(p)] for p in g["params"] if id(p) in position],
            {k: v for k, v in g.items() if k not in IMPLEMENTATION_KEYS},
        )
        for g in loop.param_groups
    ]

    def factory(masters: list[Any]) -> torch.optim.Optimizer:
        if len(masters) != len(trainable):
            raise ConfigError(
                f"{len(masters)} host masters for {len(trainable)} trainable parameters: the "
                "factory was made for another model"
            )
        built = [{**hyper, "params": [masters[i] for i in where]} for where, hyper in groups]
        return cls(built, **defaults)

    return factory


class Handover:
    """The loop's optimizer handed over (:func:`hand_over`); :meth:`remove` ends it."""

    def __init__(self, host: Any, hook: Any, loop: torch.optim.Optimizer) -> None:
        self._host = host
        self._hook = hook
        self._loop = loop

    def remove(self) -> None:
        """The loop's optimizer is its own again (the host optimizer's state is not moved
        back: save ``PlanHandle.state_dict()`` first). Idempotent."""
        if self._hook is not None:
            self._hook.remove()
            self._host._followed = None
            self._hook = None
            self._loop.__dict__.pop("zero_grad", None)


def hand_over(optimizer: Any, handle: Any) -> Handover:
    """Hand the loop's ``optimizer`` over to ``handle``'s host optimizer (module docstring).

    Args:
        optimizer: what the loop steps (a torch optimizer, or a wrapper of one such as
            Accelerate's ``AcceleratedOptimizer``); the host optimizer was built by
            :func:`factory_like` from it.
        handle: the :class:`~superneurons.memory.runtime.apply.PlanHandle` of a plan with
            ``host_optimizer``.

    Raises:
        ConfigError: the plan has no host optimizer; the groups do not match.
    """
    view = handle.optimizer
    if view is None:
        raise ConfigError("hand_over() is for plans with host_optimizer; this plan has none")
    loop = _torch_optimizer(optimizer)
    view.host.follow(loop.param_groups)
    if loop.state:
        _move_state(loop, view.host)
    hook = loop.register_step_post_hook(lambda _opt, _args, _kwargs: view.step())
    zero_grad = loop.zero_grad

    def zero_grad_here_and_on_the_host(*args: Any, **kwargs: Any) -> None:
        zero_grad(*args, **kwargs)
        view.zero_grad()

    loop.zero_grad = zero_grad_here_and_on_the_host  # type: ignore[method-assign]
    return Handover(view.host, hook, loop)


def _move_state(loop: torch.optim.Optimizer, host: Any) -> None:
    """State the loop optimizer holds (loaded from a checkpoint of a run without the host
    optimizer) goes to the host optimizer, and off the device."""
    ours = host.optimizer
    sizes = [len(g["params"]) for g in loop.param_groups]
    if sizes != [len(g["params"]) for g in ours.param_groups]:
        logger.warning(
            "the loop's optimizer holds state, but its groups (%s tensors) differ from the host "
            "optimizer's: the host optimizer starts from no state",
            sizes,
        )
    else:
        ours.load_state_dict(loop.state_dict())
        logger.info("the loop optimizer's state moved to the host optimizer")
    loop.state.clear()


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    loop = inner_optimizer(optimizer)
    if loop is None:
        raise ConfigError("the host optimizer needs the loop's optimizer: pass optimizer=")
    return loop


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer that really steps inside wrappers (``.optimizer`` of accelerate's
    ``AcceleratedOptimizer``, ``._optimizer`` of Lightning's), which may subclass ``Optimizer``
    themselves.

    A wrapper is recognised by what it holds (an inner optimizer), so a wrapper that is an
    ``Optimizer`` subclass is still unwrapped: stepping it would run its patched ``step``.

    Raises:
        ConfigError: ``optimizer`` is neither a torch optimizer nor wraps one.
    """
    seen: set[int] = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = next(
            (
                value
                for value in (getattr(optimizer, a, None) for a in ("optimizer", "_optimizer"))
                if value is not None and value is not optimizer and hasattr(value, "param_groups")
            ),
            None,
        )
        if inner is None:
            break
        optimizer = inner
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"not a torch optimizer: {type(optimizer).__name__}")
    return optimizer
