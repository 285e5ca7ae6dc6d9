"""What a model's weights hold in memory beside ``parameters()`` and ``buffers()``.

A quantized parameter carries tensors that are neither parameters nor buffers (bitsandbytes'
``Params4bit`` its ``quant_state``, ``Int8Params`` its row scales: read by
:func:`superneurons.memory.param_state.held_tensors`). They are resident for the whole run, like
the weights: :func:`weight_state_tensors` lists them, so a profile counts them with the
parameters and a meter can too.
"""

from __future__ import annotations

import torch
from torch import nn

from superneurons.memory.param_state import held_tensors

__all__ = ["weight_state_tensors"]


def weight_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors ``model``'s parameters hold in attributes of their own (a quantized weight's
    scales and codes), each once; ``[]`` for a model of plain parameters."""
    return [held.tensor for held in held_tensors(model)]
