"""What a model's weights hold in memory beside ``parameters()`` and ``buffers()``.

A quantized parameter carries tensors that are neither parameters nor buffers: bitsandbytes'
``Params4bit`` (QLoRA's nf4/fp4 weights, Dettmers et al. 2023) holds its packed 4-bit data as
the parameter (``uint8``, two weights a byte) and a ``quant_state`` with one absmax per block of
64 weights (``uint8`` under double quantisation, with a nested state of fp32 absmaxes per 256
of those and a 256-entry code) and its 16-entry nf4 code; ``Int8Params`` (LLM.int8()) holds its
row scales ``SCB`` beside the int8 weight. They are resident for the whole run, like the weights:
:func:`weight_state_tensors` finds them, read from the parameters' own attributes (no import of
bitsandbytes), so a profile counts them with the parameters and a meter can too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["weight_state_tensors"]

_MAX_DEPTH = 3  # Params4bit -> QuantState -> its nested state2 (double quantisation)


def weight_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors ``model``'s parameters hold in attributes of their own (a quantized weight's
    scales and codes), each once; ``[]`` for a model of plain parameters."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    for param in model.parameters():
        _collect(vars(param), found, seen, depth=1)
    for param in model.parameters():
        found.pop(id(param), None)
    return list(found.values())


def _collect(
    attributes: dict[str, Any], found: dict[int, torch.Tensor], seen: set[int], *, depth: int
) -> None:
    for value in attributes.values():
        if id(value) in seen or isinstance(value, (nn.Module, type)):
            continue  # bitsandbytes' Params4bit keeps its module: not its state
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), value)
        elif depth < _MAX_DEPTH and hasattr(value, "__dict__") and not callable(value):
            _collect(vars(value), found, seen, depth=depth + 1)
