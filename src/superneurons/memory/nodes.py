"""Where backward enters and leaves a unit: pre-hooks on the autograd nodes around its outputs.

The runtime prefetches pool groups at these two points (SuperNeurons' one-ahead prefetch,
Wang et al., PPoPP'18 §3.2) and the profiler records the events at which they fire in eager
PyTorch, so the predictor places each prefetch where the runtime issues it. Both go through
this module: one definition of "entered" and "left".

* *entered*: a pre-hook on the nodes of the unit's outputs (before their backward runs);
* *left*: a pre-hook on their children (the unit's next nodes): the output nodes' backward is
  over and autograd has released their saved tensors and incoming gradients. For a
  recomputed unit whose output node unpacks a saved tensor, its recompute is over too.

Node pre-hooks, not module backward hooks: those break in-place ops on a unit's outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["on_enter", "on_leave", "output_nodes"]


def output_nodes(outputs: Any) -> set[Any]:
    """The ``grad_fn`` of every tensor in ``outputs`` (a pytree) that has one."""
    return {
        t.grad_fn
        for t in tree_flatten(outputs)[0]
        if isinstance(t, torch.Tensor) and t.grad_fn is not None
    }


def on_enter(nodes: set[Any], callback: Callable[[], None]) -> None:
    """Call ``callback`` whenever backward is about to run one of ``nodes``."""
    for node in nodes:
        node.register_prehook(lambda _grads: callback())


def on_leave(nodes: set[Any], callback: Callable[[], None]) -> None:
    """Call ``callback`` whenever backward is about to run a child of ``nodes`` (not one of
    them): after the first output node's backward is over."""
    for node in nodes:
        for child, _ in node.next_functions:
            if child is not None and child not in nodes:
                child.register_prehook(lambda _grads: callback())
