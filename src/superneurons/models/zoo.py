"""The model zoo: one literal table from CLI/benchmark names to builders, plus a correctly
shaped random batch (:func:`model_input`) and the loss (:func:`default_loss`) for each name.

``build_model(name, **kw)`` and ``model_input(name, batch_size, **kw)`` accept the same keyword
arguments, so one kwargs dict describes both the model and its batch. Image models also take
``image_size`` (the ResNet ignores it for its architecture: it pools globally); language models
use ``block_size`` as the sequence length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from superneurons.errors import ConfigError
from superneurons.models.gpt import PRESETS, gpt
from superneurons.models.lstm import lstm
from superneurons.models.mlp import mlp
from superneurons.models.resnet import (
    STANDARD_DEPTHS,
    depth_to_n,
    resnet,
    resnet50,
    resnet101,
    resnet152,
)
from superneurons.models.vgg import alexnet, fc_heavy, vgg

__all__ = ["MODEL_NAMES", "build_model", "default_loss", "model_input"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _resnet_by_depth(
    *,
    depth: int | None = None,
    layers: tuple[int, ...] | None = None,
    image_size: int | None = None,
    **kwargs: Any,
) -> nn.Module:
    """``depth``: a standard depth (18, 34, 50, 101, 152) or any ``3n + 134`` of the
    SuperNeurons ``[6, 32, n, 6]`` family; ``layers`` gives stage sizes directly."""
    del image_size  # global average pooling: any input size works
    if depth is not None and layers is not None:
        raise ConfigError("resnet: give depth= or layers=, not both")
    if layers is not None:
        return resnet(layers, **kwargs)
    if depth is None:
        depth = 50
    if depth in STANDARD_DEPTHS:
        block, stages = STANDARD_DEPTHS[depth]
        kwargs.setdefault("block", block)
        return resnet(stages, **kwargs)
    return resnet((6, 32, depth_to_n(depth), 6), **kwargs)


def _drop_image_size(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def build(*, image_size: int | None = None, **kwargs: Any) -> nn.Module:
        del image_size
        return builder(**kwargs)

    return build


# NOTE: a literal dict, not a registry: the whole zoo is visible here.
_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "resnet": _resnet_by_depth,
    "resnet50": _drop_image_size(resnet50),
    "resnet101": _drop_image_size(resnet101),
    "resnet152": _drop_image_size(resnet152),
    "vgg": vgg,
    "alexnet": alexnet,
    "fc-heavy": fc_heavy,
    "gpt": gpt,
    "lstm": lstm,
    "mlp": mlp,
}
MODEL_NAMES: tuple[str, ...] = tuple(_BUILDERS)
_LANGUAGE_MODELS = frozenset({"gpt", "lstm"})
# (in_channels, image_size, num_classes) when the caller does not say.
_IMAGE_DEFAULTS: dict[str, tuple[int, int, int]] = {
    "resnet": (3, 224, 1000),
    "resnet50": (3, 224, 1000),
    "resnet101": (3, 224, 1000),
    "resnet152": (3, 224, 1000),
    "vgg": (3, 224, 1000),
    "alexnet": (3, 224, 1000),
    "fc-heavy": (1, 28, 10),
    "mlp": (1, 28, 10),
}


def _check_name(name: str) -> None:
    if name not in _BUILDERS:
        raise ConfigError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """Build a zoo model in fp32 with its standard initialisation.

    Raises:
        ConfigError: unknown name (the message lists the names) or bad hyper-parameters.
    """
    _check_name(name)
    try:
        return _BUILDERS[name](**kwargs)
    except TypeError as exc:  # an unexpected keyword: say which model rejected it
        raise ConfigError(f"model {name!r}: {exc}") from exc


def model_input(
    name: str, batch_size: int, *, generator: torch.Generator | None = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random ``(inputs, targets)`` batch shaped for ``build_model(name, **kwargs)``.

    Images: ``(B, C, H, W)`` float32 and ``(B,)`` int64 labels. Language models: ``(B, T)``
    int64 token ids and ``(B, T)`` next-token targets, ``T = block_size``.
    """
    _check_name(name)
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if name in _LANGUAGE_MODELS:
        preset = PRESETS.get(kwargs.get("preset") or "", {})
        vocab = kwargs.get("vocab_size") or preset.get("vocab_size", 128)
        seq_len = kwargs.get("block_size") or preset.get("block_size", 128)
        shape = (batch_size, int(seq_len))
        idx = torch.randint(0, int(vocab), shape, generator=generator)
        return idx, torch.randint(0, int(vocab), shape, generator=generator)
    channels, size, classes = _IMAGE_DEFAULTS[name]
    if kwargs.get("small_input"):
        size = 28
    channels = int(kwargs.get("in_channels", channels))
    size = int(kwargs.get("image_size") or size)
    classes = int(kwargs.get("num_classes", classes))
    images = torch.randn(batch_size, channels, size, size, generator=generator)
    return images, torch.randint(0, classes, (batch_size,), generator=generator)


def _lm_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def default_loss(name: str) -> LossFn:
    """Cross-entropy for every zoo model; language models flatten ``(B, T, V)`` logits."""
    _check_name(name)
    return _lm_cross_entropy if name in _LANGUAGE_MODELS else F.cross_entropy
