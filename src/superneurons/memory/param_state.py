"""What a parameter holds beside its data: a quantized weight's scales and codes.

A quantized parameter carries tensors that are neither parameters nor buffers: bitsandbytes'
``Params4bit`` (QLoRA's nf4/fp4 weights, Dettmers et al. 2023) holds its packed 4-bit data as
the parameter (``uint8``, two weights a byte) and a ``quant_state`` with one absmax per block of
64 weights (``uint8`` under double quantisation, with a nested ``state2`` of fp32 absmaxes per
256 of those and a 256-entry code), an ``offset`` and its 16-entry nf4 code; ``Int8Params``
(LLM.int8()) holds its row scales ``SCB`` beside the int8 weight. :func:`held_tensors` finds
them, read from the parameters' own attributes (no import of bitsandbytes): one definition for
the profile (they are resident like the weights, and stream with them:
:func:`superneurons.memory.profile_types.unit_params`) and for the runtime that streams them
(:mod:`superneurons.memory.offload.weights`, which points the same attributes at the host and
device copies).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["HeldTensor", "held_tensors", "int8_parameter"]

_MAX_DEPTH = 3  # Params4bit -> QuantState -> its nested state2 (double quantisation)


@dataclass(frozen=True)
class HeldTensor:
    """A tensor parameters hold in attributes of their own.

    Attributes:
        fqn: the first holding parameter's name and the attribute path below it
            (``"...q_proj.weight.quant_state.state2.absmax"``).
        tensor: the tensor (each tensor object once).
        owners: every ``(object, attribute)`` pointing at it (a ``QuantState`` and ``"absmax"``).
        params: the names of the parameters it was reached from, in ``named_parameters`` order.
    """

    fqn: str
    tensor: torch.Tensor
    owners: tuple[tuple[Any, str], ...]
    params: tuple[str, ...]


def held_tensors(model: nn.Module) -> list[HeldTensor]:
    """The tensors ``model``'s parameters hold in attributes of their own, each tensor object
    once, in the order the parameters come; ``[]`` for a model of plain parameters."""
    params = dict(model.named_parameters())
    is_param = {id(p) for p in params.values()}
    found: dict[int, tuple[str, torch.Tensor, list[tuple[Any, str]], list[str]]] = {}
    for name, param in params.items():
        for path, owner, attr, tensor in _walk(param, name, depth=1, seen={id(param)}):
            if id(tensor) in is_param:
                continue
            entry = found.setdefault(id(tensor), (path, tensor, [], []))
            if not any(o is owner and a == attr for o, a in entry[2]):
                entry[2].append((owner, attr))
            if name not in entry[3]:
                entry[3].append(name)
    return [
        HeldTensor(path, tensor, tuple(owners), tuple(names))
        for path, tensor, owners, names in found.values()
    ]


def _walk(
    holder: Any, path: str, *, depth: int, seen: set[int]
) -> Iterator[tuple[str, Any, str, torch.Tensor]]:
    """``(path, holder, attribute, tensor)`` below ``holder``'s attributes."""
    for attr, value in vars(holder).items():
        if id(value) in seen or isinstance(value, (nn.Module, type)):
            continue  # bitsandbytes' Params4bit keeps its module: not its state
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            yield f"{path}.{attr}", holder, attr, value
        elif depth < _MAX_DEPTH and hasattr(value, "__dict__") and not callable(value):
            yield from _walk(value, f"{path}.{attr}", depth=depth + 1, seen=seen)


def int8_parameter(param: nn.Parameter, module: nn.Module) -> bool:
    """``param`` is an LLM.int8() weight or held by one's layer: bitsandbytes' ``Int8Params``
    or a parameter of a ``Linear8bitLt`` (also :mod:`superneurons.memory.sizing.quantized`'s
    stand-in, its subclass). The layer keeps the weight's int8 values and scales in its own
    ``state`` (``MatmulLtState.CB`` / ``SCB``) beside the parameter: such weights cannot
    stream."""
    if type(param).__name__ == "Int8Params":
        return True
    return any(cls.__name__ == "Linear8bitLt" for cls in type(module).__mro__)
