"""FC-heavy convolutional classifiers: VGG (Simonyan & Zisserman, ICLR 2015), AlexNet
(Krizhevsky et al., NIPS 2012) and a small "fc-heavy" net for 28x28 inputs.

Most of their parameters sit in the fully connected head (AlexNet: 58.6M of 61.1M), which is
what makes them the showcase for gradient compression (Wang et al., HPDC'20, use AlexNet) and
for offloading the outputs of compute-heavy layers (SuperNeurons, PPoPP'18). Every model takes
``num_classes``, ``in_channels`` and ``image_size`` so 1-channel 28x28 Fashion-MNIST works; the
head's input size is computed from ``image_size`` (no dummy forward).
"""

from __future__ import annotations

import torch
from torch import nn

from superneurons.errors import ConfigError

__all__ = ["ConvClassifier", "alexnet", "fc_heavy", "vgg"]

# "M" = 2x2 max-pool (He/torchvision naming: configurations A and D of the VGG paper).
VGG_CONFIGS: dict[str, tuple[int | str, ...]] = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (
        64,
        64,
        "M",
        128,
        128,
        "M",
        256,
        256,
        256,
        "M",
        512,
        512,
        512,
        "M",
        512,
        512,
        512,
        "M",
    ),
}


class ConvClassifier(nn.Module):
    """``features`` (convs) -> flatten -> ``classifier`` (the FC head)."""

    def __init__(self, features: nn.Sequential, classifier: nn.Sequential) -> None:
        super().__init__()
        self.features = features
        self.classifier = classifier
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, 0.01)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, C, H, W)
        return self.classifier(torch.flatten(self.features(x), 1))  # (B, num_classes)


def _check(name: str, *, num_classes: int, in_channels: int, image_size: int) -> None:
    for label, value in (
        ("num_classes", num_classes),
        ("in_channels", in_channels),
        ("image_size", image_size),
    ):
        if value < 1:
            raise ConfigError(f"{name}: {label} must be >= 1, got {value}")


def _scaled(channels: int, width_mult: float) -> int:
    if width_mult <= 0:
        raise ConfigError(f"width_mult must be > 0, got {width_mult}")
    return max(1, round(channels * width_mult))


def _head(in_features: int, fc_width: int, num_classes: int, dropout: float) -> nn.Sequential:
    if fc_width < 1:
        raise ConfigError(f"fc_width must be >= 1, got {fc_width}")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {dropout}")
    return nn.Sequential(
        nn.Dropout(dropout),
        nn.Linear(in_features, fc_width),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(fc_width, fc_width),
        nn.ReLU(inplace=True),
        nn.Linear(fc_width, num_classes),
    )


def vgg(
    config: str = "vgg16",
    *,
    num_classes: int = 1000,
    in_channels: int = 3,
    image_size: int = 224,
    width_mult: float = 1.0,
    fc_width: int = 4096,
    dropout: float = 0.5,
    batch_norm: bool = False,
) -> ConvClassifier:
    """VGG conv stack + 3-layer FC head. A max-pool is skipped once the map is 1x1, so small
    inputs (28x28) keep a valid shape. VGG-16 at 224x224: 138.4M parameters."""
    _check("vgg", num_classes=num_classes, in_channels=in_channels, image_size=image_size)
    if config not in VGG_CONFIGS:
        raise ConfigError(f"vgg: config must be one of {sorted(VGG_CONFIGS)}, got {config!r}")
    layers: list[nn.Module] = []
    channels, size = in_channels, image_size
    for item in VGG_CONFIGS[config]:
        if item == "M":
            if size >= 2:
                layers.append(nn.MaxPool2d(2, 2))
                size //= 2
            continue
        out = _scaled(int(item), width_mult)
        layers.append(nn.Conv2d(channels, out, 3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(out))
        layers.append(nn.ReLU(inplace=True))
        channels = out
    return ConvClassifier(
        nn.Sequential(*layers), _head(channels * size * size, fc_width, num_classes, dropout)
    )


def _conv_out(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def alexnet(
    *,
    num_classes: int = 1000,
    in_channels: int = 3,
    image_size: int = 224,
    width_mult: float = 1.0,
    fc_width: int = 4096,
    dropout: float = 0.5,
) -> ConvClassifier:
    """AlexNet (torchvision's single-tower variant). Inputs smaller than 64 px get a 3x3
    stride-1 stem instead of the 11x11 stride-4 one; at 28x28 the head still holds ~26M of the
    parameters (FC-heavy), at 224x224 61.1M in total."""
    _check("alexnet", num_classes=num_classes, in_channels=in_channels, image_size=image_size)
    c1, c2, c3, c4, c5 = (_scaled(c, width_mult) for c in (64, 192, 384, 256, 256))
    small = image_size < 64
    stem_k, stem_s, stem_p = (3, 1, 1) if small else (11, 4, 2)
    pool_k = 2 if small else 3
    size = _conv_out(image_size, stem_k, stem_s, stem_p)
    layers: list[nn.Module] = [nn.Conv2d(in_channels, c1, stem_k, stem_s, stem_p), nn.ReLU(True)]

    def pool() -> None:
        nonlocal size
        if size >= pool_k:
            layers.append(nn.MaxPool2d(pool_k, 2))
            size = _conv_out(size, pool_k, 2, 0)

    pool()
    layers += [nn.Conv2d(c1, c2, 5, padding=2), nn.ReLU(True)]
    pool()
    layers += [nn.Conv2d(c2, c3, 3, padding=1), nn.ReLU(True)]
    layers += [nn.Conv2d(c3, c4, 3, padding=1), nn.ReLU(True)]
    layers += [nn.Conv2d(c4, c5, 3, padding=1), nn.ReLU(True)]
    pool_k = 3  # the last pool is 3x3/2 at every size (28 -> 7 -> 3)
    pool()
    return ConvClassifier(
        nn.Sequential(*layers), _head(c5 * size * size, fc_width, num_classes, dropout)
    )


def fc_heavy(
    *,
    num_classes: int = 10,
    in_channels: int = 1,
    image_size: int = 28,
    conv_channels: int = 64,
    fc_width: int = 2048,
    dropout: float = 0.0,
) -> ConvClassifier:
    """Two 3x3 convs + one 2x2 pool, then two wide FC layers: at the defaults 30.0M parameters,
    97% in the FC head (64*14*14*2048 = 25.7M in the first FC layer alone). Made for the
    network benchmark: a big gradient from a model that trains in seconds on 28x28x1."""
    _check("fc-heavy", num_classes=num_classes, in_channels=in_channels, image_size=image_size)
    if conv_channels < 1:
        raise ConfigError(f"fc-heavy: conv_channels must be >= 1, got {conv_channels}")
    half = max(1, conv_channels // 2)
    features = nn.Sequential(
        nn.Conv2d(in_channels, half, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(half, conv_channels, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2, 2),
    )
    size = image_size // 2
    if size < 1:
        raise ConfigError(f"fc-heavy: image_size must be >= 2, got {image_size}")
    return ConvClassifier(
        features, _head(conv_channels * size * size, fc_width, num_classes, dropout)
    )
