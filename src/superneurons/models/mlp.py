"""A small multi-layer perceptron for 28x28 images (the classic MNIST baseline)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from superneurons.errors import ConfigError

__all__ = ["mlp"]


def mlp(
    *,
    num_classes: int = 10,
    in_channels: int = 1,
    image_size: int = 28,
    hidden: Sequence[int] = (512, 256),
    dropout: float = 0.0,
) -> nn.Sequential:
    """Flatten -> [Linear -> ReLU (-> Dropout)] per hidden width -> Linear (0.54M parameters at
    the defaults)."""
    if any(width < 1 for width in hidden):
        raise ConfigError(f"mlp: hidden widths must be >= 1, got {tuple(hidden)}")
    for name, value in (
        ("num_classes", num_classes),
        ("in_channels", in_channels),
        ("image_size", image_size),
    ):
        if value < 1:
            raise ConfigError(f"mlp: {name} must be >= 1, got {value}")
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_channels * image_size * image_size
    for out in hidden:
        layers += [nn.Linear(width, out), nn.ReLU(inplace=True)]
        if dropout:
            layers.append(nn.Dropout(dropout))
        width = out
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)
