"""Residual networks (He et al., CVPR 2016) and the SuperNeurons "going deeper" family.

Every residual block is its own module and every stage an ``nn.Sequential`` of blocks, so a
memory planner can treat a block as a checkpointable unit (keep / offload / recompute its saved
activations together, Wang et al., PPoPP'18, section 3).

The deep family is the bottleneck ResNet with stage sizes ``[6, 32, n, 6]`` used in the
SuperNeurons paper's depth experiments: every bottleneck block holds 3 weight layers, plus the
stem convolution and the classifier, so ``depth = 3 * (6 + 32 + n + 6) + 2 = 3n + 134``
(``n = 152`` -> 590 layers, ``n = 789`` -> ResNet-2501).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from superneurons.errors import ConfigError

__all__ = [
    "BasicBlock",
    "Bottleneck",
    "ResNet",
    "depth_to_n",
    "n_to_depth",
    "resnet",
    "resnet50",
    "resnet101",
    "resnet152",
    "resnet_deep",
]

# Standard ImageNet depths (He et al., table 1) -> (block, stage sizes).
STANDARD_DEPTHS: dict[int, tuple[str, tuple[int, int, int, int]]] = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
}
_DEEP_FIXED_BLOCKS = 6 + 32 + 6  # stages 1, 2 and 4 of the [6, 32, n, 6] family


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with an identity (or 1x1 projection) shortcut."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(in_planes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided, as in torchvision's "ResNet v1.5"), 1x1 expand by 4."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out_planes = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(in_planes, out_planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def _shortcut(in_planes: int, out_planes: int, stride: int) -> nn.Sequential | None:
    if stride == 1 and in_planes == out_planes:
        return None
    return nn.Sequential(
        nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False),
        nn.BatchNorm2d(out_planes),
    )


class ResNet(nn.Module):
    """Stem -> ``layer1..layer4`` (``nn.Sequential`` of blocks) -> global pool -> ``fc``."""

    def __init__(
        self,
        layers: Sequence[int],
        *,
        block: str = "bottleneck",
        num_classes: int = 1000,
        in_channels: int = 3,
        width: int = 64,
        small_input: bool = False,
    ) -> None:
        super().__init__()
        block_cls = _block_class(block)
        if len(layers) != 4 or any(int(n) < 1 for n in layers):
            raise ConfigError(f"resnet: layers must be 4 positive stage sizes, got {tuple(layers)}")
        for name, value in (("num_classes", num_classes), ("in_channels", in_channels)):
            if value < 1:
                raise ConfigError(f"resnet: {name} must be >= 1, got {value}")
        if width < 1:
            raise ConfigError(f"resnet: width must be >= 1, got {width}")
        self.layers = tuple(int(n) for n in layers)
        if small_input:  # 28x28 / 32x32 inputs: 3x3 stem, no max-pool
            self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
            self.maxpool: nn.Module = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        in_planes = width
        stages: list[nn.Sequential] = []
        for index, n_blocks in enumerate(self.layers):
            planes = width * 2**index
            blocks: list[nn.Module] = []
            for j in range(n_blocks):
                stride = 2 if (index > 0 and j == 0) else 1
                blocks.append(block_cls(in_planes, planes, stride))
                in_planes = planes * block_cls.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_planes, num_classes)
        _init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, C, H, W)
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))  # (B, num_classes)


def _block_class(block: str) -> type[BasicBlock] | type[Bottleneck]:
    classes: dict[str, type[BasicBlock] | type[Bottleneck]] = {
        "basic": BasicBlock,
        "bottleneck": Bottleneck,
    }
    if block not in classes:
        raise ConfigError(f"resnet: block must be one of {sorted(classes)}, got {block!r}")
    return classes[block]


def _init_weights(model: nn.Module) -> None:
    """He (fan-out) init for convs, BN to (1, 0): the torchvision defaults."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


def resnet(
    layers: Sequence[int] = (3, 4, 6, 3),
    *,
    block: str = "bottleneck",
    num_classes: int = 1000,
    in_channels: int = 3,
    width: int = 64,
    small_input: bool = False,
) -> ResNet:
    """A ResNet with the given stage sizes (default: ResNet-50)."""
    return ResNet(
        layers,
        block=block,
        num_classes=num_classes,
        in_channels=in_channels,
        width=width,
        small_input=small_input,
    )


def resnet50(**kwargs: object) -> ResNet:
    """ResNet-50 (25.6M parameters at 1000 classes)."""
    return resnet(STANDARD_DEPTHS[50][1], **kwargs)  # type: ignore[arg-type]


def resnet101(**kwargs: object) -> ResNet:
    """ResNet-101 (44.5M parameters at 1000 classes)."""
    return resnet(STANDARD_DEPTHS[101][1], **kwargs)  # type: ignore[arg-type]


def resnet152(**kwargs: object) -> ResNet:
    """ResNet-152 (60.2M parameters at 1000 classes)."""
    return resnet(STANDARD_DEPTHS[152][1], **kwargs)  # type: ignore[arg-type]


def n_to_depth(n: int) -> int:
    """Depth (weight layers) of the ``[6, 32, n, 6]`` bottleneck ResNet: ``3n + 134``."""
    if n < 1:
        raise ConfigError(f"resnet_deep: n must be >= 1, got {n}")
    return 3 * (_DEEP_FIXED_BLOCKS + n) + 2


def depth_to_n(depth: int) -> int:
    """Inverse of :func:`n_to_depth`; the depth must be ``3n + 134`` for some ``n >= 1``."""
    n, rest = divmod(depth - 134, 3)
    if n < 1 or rest != 0:
        lower = n_to_depth(max(n, 1))
        raise ConfigError(
            f"resnet depth {depth} is not reachable by the [6, 32, n, 6] family "
            f"(depth = 3n + 134, n >= 1): try {lower} or {lower + 3}, "
            f"or a standard depth {sorted(STANDARD_DEPTHS)}"
        )
    return n


def resnet_deep(n: int, **kwargs: object) -> ResNet:
    """The SuperNeurons depth family: bottleneck ResNet ``[6, 32, n, 6]`` (depth ``3n + 134``)."""
    n_to_depth(n)  # validates n
    return resnet((6, 32, n, 6), **kwargs)  # type: ignore[arg-type]
