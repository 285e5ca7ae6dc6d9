"""Model zoo: shapes, parameter counts, the deep-ResNet depth formula, a forward+backward per
model at tiny size, and the error messages."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from superneurons.errors import ConfigError
from superneurons.models import (
    MODEL_NAMES,
    Bottleneck,
    build_model,
    default_loss,
    depth_to_n,
    model_input,
    n_to_depth,
    resnet_deep,
)


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _blocks(model: nn.Module) -> int:
    return sum(isinstance(m, Bottleneck) for m in model.modules())


TINY: dict[str, dict[str, Any]] = {
    "resnet": {"layers": (1, 1, 1, 1), "width": 4, "small_input": True, "num_classes": 10},
    "resnet50": {"width": 2, "num_classes": 5, "image_size": 32},
    "resnet101": {"width": 1, "num_classes": 5, "image_size": 32},
    "resnet152": {"width": 1, "num_classes": 5, "image_size": 32},
    "vgg": {"config": "vgg11", "image_size": 28, "in_channels": 1, "num_classes": 10,
            "width_mult": 0.0625, "fc_width": 16},
    "alexnet": {"image_size": 28, "in_channels": 1, "num_classes": 10, "width_mult": 0.0625,
                "fc_width": 16},
    "fc-heavy": {"conv_channels": 4, "fc_width": 16},
    "gpt": {"vocab_size": 17, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 8},
    "lstm": {"vocab_size": 17, "block_size": 8, "n_embd": 8, "hidden_size": 8},
    "mlp": {"hidden": (8,)},
}  # fmt: skip


def test_zoo_names_are_the_documented_ones() -> None:
    assert set(MODEL_NAMES) == set(TINY)


@pytest.mark.parametrize("name", sorted(TINY))
def test_forward_backward_at_tiny_size(name: str) -> None:
    model = build_model(name, **TINY[name])
    inputs, targets = model_input(name, 2, **TINY[name])
    logits = model(inputs)
    assert logits.shape[:-1] == targets.shape
    loss = default_loss(name)(logits, targets)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads if g is not None) > 0


def test_standard_parameter_counts() -> None:
    # Published counts: ResNet-50 25.557M (torchvision), GPT-2 small 124.44M (tied embeddings).
    with torch.device("meta"):
        assert _params(build_model("resnet50")) == 25_557_032
        assert _params(build_model("resnet", depth=50)) == 25_557_032
        assert _params(build_model("gpt", preset="gpt2")) == 124_439_808
        assert _params(build_model("alexnet")) == 61_100_840
        assert _params(build_model("fc-heavy")) >= 20_000_000


def test_fc_heavy_is_fc_heavy() -> None:
    with torch.device("meta"):
        model = build_model("fc-heavy")
    fc = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert fc / _params(model) > 0.9


def test_deep_resnet_depth_formula_anchors() -> None:
    # The SuperNeurons figures: n = 152 -> ResNet-590, n = 789 -> ResNet-2501.
    assert (n_to_depth(152), n_to_depth(789)) == (590, 2501)
    assert all(depth_to_n(n_to_depth(n)) == n for n in range(1, 1000))


@pytest.mark.parametrize("n", [1, 152])
def test_deep_resnet_counts_its_layers(n: int) -> None:
    depth = n_to_depth(n)
    assert depth == 3 * n + 134
    with torch.device("meta"):
        model = resnet_deep(n)
    assert _blocks(model) == 6 + 32 + n + 6
    convs_and_fc = sum(
        isinstance(m, nn.Conv2d | nn.Linear)
        for name, m in model.named_modules()
        if "downsample" not in name
    )
    assert convs_and_fc == depth


def test_resnet_zoo_depth_picks_the_family() -> None:
    with torch.device("meta"):
        model = build_model("resnet", depth=590)
    assert _blocks(model) == 6 + 32 + 152 + 6
    assert isinstance(model.layer3, nn.Sequential) and len(model.layer3) == 152


def test_language_model_batch_matches_vocab() -> None:
    idx, targets = model_input("gpt", 3, vocab_size=11, block_size=5)
    assert idx.shape == targets.shape == (3, 5) and idx.dtype == torch.int64
    assert int(idx.max()) < 11


def test_errors_say_what_to_do() -> None:
    with pytest.raises(ConfigError, match="choose one of: resnet"):
        build_model("resnet9000")
    with pytest.raises(ConfigError, match="3n \\+ 134"):
        build_model("resnet", depth=201)
    with pytest.raises(ConfigError, match="divisible"):
        build_model("gpt", n_embd=10, n_head=3)
    with pytest.raises(ConfigError, match="model 'mlp'"):
        build_model("mlp", not_a_kwarg=1)
    with pytest.raises(ConfigError, match="block_size"):
        build_model("gpt", block_size=4)(torch.zeros(1, 5, dtype=torch.int64))
