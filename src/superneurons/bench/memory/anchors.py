"""The anchors of the memory benchmark: what PyTorch itself offers to trade time for memory.

* ``checkpoint``: non-reentrant ``torch.utils.checkpoint`` around every unit (Chen et al. 2016),
  except a unit that only overwrites its input in place (a parameter-free ``inplace=True``
  module such as the ResNet stem's ``ReLU``): checkpoint cannot start at a tensor its own
  forward mutates ("output 0 of Relu is at version 1; expected version 0" in backward), and
  such a unit runs as in eager, its output being the tensor the next unit's checkpoint keeps
  anyway;
* ``selective``: per unit, selective checkpoint contexts (``superneurons.compat``) with a policy that saves
  convolution, matmul and attention outputs and recomputes the rest (Megatron-style selective
  recompute, Korthikanti et al. 2022);
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` on CUDA: every saved
  tensor, weights included, copied to pinned host memory in forward and back on demand. On a
  CPU build the same semantics are simulated (host copies made outside the live count);
* ``compile``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` (the
  min-cut partitioner's memory budget, a fraction of the activations it may keep).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

__all__ = [
    "ANCHORS",
    "activation_memory_budget",
    "checkpointed_units",
    "compile_unavailable",
    "overwrites_its_input",
    "save_on_cpu",
    "selective_policy_context",
]

ANCHORS: tuple[str, ...] = ("checkpoint", "selective", "save_on_cpu", "compile")

# Ops whose outputs selective checkpointing saves (the expensive ones to recompute).
_SAVED_OPS = (
    "convolution",
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


@contextlib.contextmanager
def checkpointed_units(
    model: nn.Module, units: Sequence[str], *, selective: bool = False
) -> Iterator[None]:
    """Run every unit's forward under non-reentrant checkpoint (``selective``: with the SAC
    policy), in-place units excepted (:func:`overwrites_its_input`); the original forwards
    come back on exit."""
    context_fn = selective_policy_context if selective else None
    modules = [model.get_submodule(u) for u in units]
    modules = [m for m in modules if not overwrites_its_input(m)]
    for module in modules:
        module.forward = _checkpointed(module.forward, context_fn)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module in modules:
            del module.forward


def overwrites_its_input(module: nn.Module) -> bool:
    """A parameter-free module built with ``inplace=True`` (``nn.ReLU``, ``nn.Dropout``, ...):
    its forward writes over the tensor it is given, so a checkpoint cannot begin there."""
    return bool(getattr(module, "inplace", False)) and not any(True for _ in module.parameters())


def _checkpointed(forward: Callable[..., Any], context_fn: Callable[..., Any] | None) -> Any:
    from torch.utils.checkpoint import checkpoint, noop_context_fn

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(
            forward, *args, use_reentrant=False, context_fn=context_fn or noop_context_fn, **kwargs
        )

    return run


def selective_policy_context() -> Any:
    """SAC contexts: save conv / matmul / attention outputs, recompute everything else."""
    from superneurons.compat import selective_checkpoint_contexts

    aten = torch.ops.aten
    heavy = {getattr(aten, name).default for name in _SAVED_OPS if hasattr(aten, name)}
    return selective_checkpoint_contexts(lambda op: op in heavy)


@contextlib.contextmanager
def save_on_cpu(device: torch.device) -> Iterator[None]:
    """``torch.autograd.graph.save_on_cpu(pin_memory=True)`` on CUDA; on CPU its semantics:
    every saved tensor is copied to the host in forward (outside the device count) and copied
    back on unpack (inside it)."""
    if device.type == "cuda":
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            yield
        return

    def pack(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        with _disable_current_modes():
            return tensor.device, tensor.detach().clone()  # the device->host copy

    def unpack(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        where, host = packed
        return host.clone().to(where)  # the host->device copy, a new device tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def compile_unavailable(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot run here (None: it can)."""
    try:
        import torch._dynamo  # noqa: F401
        import torch._functorch.config as functorch_config
    except ImportError as exc:  # pragma: no cover - depends on the build
        return f"torch.compile unavailable: {exc}"
    if not hasattr(functorch_config, "activation_memory_budget"):
        return "this torch has no torch._functorch.config.activation_memory_budget"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch.compile on CUDA needs triton (pip install triton)"
    return None


@contextlib.contextmanager
def activation_memory_budget(fraction: float) -> Iterator[None]:
    """The min-cut partitioner's activation memory budget for the compiles inside."""
    import torch._functorch.config as functorch_config

    with functorch_config.patch(activation_memory_budget=fraction):
        yield
