"""LoRA adapters that keep their input at the base's precision.

PEFT's LoRA layer casts its input to the adapters' dtype before ``lora_A`` (``get_peft_model``
keeps adapters in fp32 on a bf16 or 4-bit base), and ``lora_A``'s matmul saves that cast for its
weight's gradient: an fp32 copy of a bf16 activation, twice its bytes, made and kept by every
adapted layer -- a block's q, k and v projections each keep their own copy of the same normed
input. With :func:`keep_adapter_inputs`, PEFT's cast is switched off (its own
``cast_input_dtype_enabled``) and ``lora_A`` casts inside a function that saves the input as it
came (one storage, shared with every other save of it) and casts it again in backward, through
the ops eager runs, so values and gradients are bit for bit eager's. The cost: one cast of the
input per adapter in backward.

It applies where the cast exists and nothing else reads the cast: plain LoRA (no DoRA or other
variant), the adapter's dropout off (``lora_dropout=0``: PEFT's identity; a dropout would mask
the fp32 copy), ``lora_A`` without bias, adapters in another dtype than their base computes in.
Under autocast ``lora_A`` runs as PEFT runs it (autocast decides the matmul's dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory.forwards import ForwardPatches

__all__ = ["AdapterInputsHandle", "adapter_inputs", "base_compute_dtype", "keep_adapter_inputs"]


def adapter_inputs(model: nn.Module) -> tuple[str, ...]:
    """The fqns of ``model``'s PEFT LoRA layers whose adapters can keep their input at the
    base's precision (module docstring), in module order; ``()`` without PEFT adapters."""
    return tuple(name for name, module in model.named_modules() if _eligible(module))


class AdapterInputsHandle(ForwardPatches):
    """Undoes :func:`keep_adapter_inputs` (``remove()``, idempotent): PEFT's casts back on, the
    adapters' forwards restored."""

    def __init__(self) -> None:
        super().__init__()
        self._casts: list[tuple[Any, bool]] = []

    def switch_cast_off(self, layer: Any) -> None:
        """Turn PEFT's cast of ``layer``'s input off until :meth:`remove`."""
        self._casts.append((layer, bool(layer.cast_input_dtype_enabled)))
        layer.cast_input_dtype_enabled = False

    def remove(self) -> None:
        super().remove()
        for layer, enabled in reversed(self._casts):
            layer.cast_input_dtype_enabled = enabled
        self._casts.clear()


def keep_adapter_inputs(model: nn.Module, fqns: Sequence[str]) -> AdapterInputsHandle:
    """Make the LoRA layers ``fqns`` of ``model`` keep their adapters' input at the base's
    precision until the handle is removed.

    Raises:
        ConfigError: a fqn is not a LoRA layer of ``model`` this applies to (re-plan the model).
    """
    handle = AdapterInputsHandle()
    try:
        for fqn in fqns:
            try:
                layer: Any = model.get_submodule(fqn)
            except AttributeError as exc:
                raise ConfigError(
                    f"the plan keeps the adapter inputs of {fqn!r}, which "
                    f"{type(model).__name__} does not have: re-plan this model"
                ) from exc
            if not _eligible(layer):
                raise ConfigError(
                    f"{fqn!r} is not a plain LoRA layer with fp32 adapters on a narrower base and "
                    "no dropout (the plan was made for another configuration): re-plan this model"
                )
            handle.switch_cast_off(layer)
            for linear in layer.lora_A.values():
                handle.patch(linear, _upcasting(linear))
    except BaseException:
        handle.remove()
        raise
    return handle


def _eligible(module: Any) -> bool:
    names = ("lora_A", "lora_dropout", "lora_variant", "cast_input_dtype_enabled", "base_layer")
    if not all(hasattr(module, name) for name in names):
        return False
    adapters = module.lora_A
    if not isinstance(adapters, nn.ModuleDict) or not adapters or module.lora_variant:
        return False
    base = base_compute_dtype(module.get_base_layer())
    for name, linear in adapters.items():
        plain = type(linear) is nn.Linear and linear.bias is None
        if not plain or type(module.lora_dropout[name]) is not nn.Identity:
            return False
        if base is None or linear.weight.dtype == base:
            return False
    return True


def base_compute_dtype(base: nn.Module) -> torch.dtype | None:
    """The dtype the base layer computes in (bitsandbytes' ``compute_dtype``, else its weight's
    when floating); None when unknown."""
    compute = getattr(base, "compute_dtype", None)
    if isinstance(compute, torch.dtype):
        return compute
    weight = getattr(base, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point:
        return weight.dtype
    return None


def _upcasting(linear: nn.Linear) -> Any:
    original = linear.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled() or x.dtype == linear.weight.dtype:
            return original(x)
        return _UpcastLinear.apply(x, linear.weight)  # type: ignore[no-any-return]

    return forward


class _UpcastLinear(torch.autograd.Function):
    """``F.linear(x.to(weight.dtype), weight)`` that saves ``x``, not its cast."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x.to(weight.dtype), weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        wants = ctx.needs_input_grad[:2]
        with torch.enable_grad():  # eager's ops again: the cast, the matmul, their backward
            leaf = x.detach().requires_grad_(wants[0])
            w = weight.detach().requires_grad_(wants[1])
            out = F.linear(leaf.to(w.dtype), w)
            wanted = [t for t, want in zip((leaf, w), wants, strict=True) if want]
            found = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return tuple(next(found) if want else None for want in wants)
