"""Hugging Face ``transformers`` models for the codec benchmark: architectures we did not write
or tune, so the codec verdict does not rest on the project's own zoo alone.

* ``gpt2``: ``GPT2LMHeadModel`` from a tiny ``GPT2Config`` (the reference GPT-2 architecture:
  learned positions, GELU MLP, tied embeddings), trained on Shakespeare characters.
* ``resnet``: ``ResNetForImageClassification`` with the ResNet-18 shape of
  ``microsoft/resnet-18`` (basic blocks, depths 2-2-2-2, widths 64-512), one input channel,
  trained on Fashion-MNIST.

Both are wrapped to return plain logits, so the zoo's losses apply. ``transformers`` is
imported only when a model is built.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from superneurons.errors import ConfigError

__all__ = ["HF_MODELS", "build_hf_model"]


class _Logits(nn.Module):
    """Call a ``transformers`` model and return its ``.logits``."""

    def __init__(self, model: nn.Module, input_name: str) -> None:
        super().__init__()
        self.model = model
        self.input_name = input_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        extra: dict[str, Any] = {"use_cache": False} if self.input_name == "input_ids" else {}
        out = self.model(**{self.input_name: inputs}, **extra)
        logits: torch.Tensor = out.logits
        return logits


def _gpt2(*, vocab_size: int, block_size: int = 64, n_layer: int = 4, n_head: int = 4,
          n_embd: int = 192) -> nn.Module:  # fmt: skip
    from transformers.models.gpt2 import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=block_size,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
    )
    return _Logits(GPT2LMHeadModel(config), "input_ids")


def _resnet(*, in_channels: int = 1, num_classes: int = 10) -> nn.Module:
    from transformers.models.resnet import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        num_channels=in_channels,
        embedding_size=64,
        hidden_sizes=[64, 128, 256, 512],
        depths=[2, 2, 2, 2],
        layer_type="basic",
    )
    config.num_labels = num_classes  # a PretrainedConfig property, not a ResNetConfig argument
    return _Logits(ResNetForImageClassification(config), "pixel_values")


HF_MODELS = {"gpt2": _gpt2, "resnet": _resnet}


def build_hf_model(name: str, **kwargs: Any) -> nn.Module:
    """A ``transformers`` model by benchmark name (``gpt2`` or ``resnet``)."""
    if name not in HF_MODELS:
        raise ConfigError(f"unknown HF model {name!r}; choose from {', '.join(HF_MODELS)}")
    builder: Any = HF_MODELS[name]
    model: nn.Module = builder(**kwargs)
    return model
