"""What the network bench trains on: Fashion-MNIST where the model takes it, else random."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from superneurons.bench.network.data import bench_batches, real_data_fits
from superneurons.bench.network.run import DEFAULT_MODELS, NetworkBenchConfig
from superneurons.data.fashion_mnist import DEFAULT_ROOT
from superneurons.errors import ConfigError
from superneurons.models import build_model

HAVE_FASHION = (Path(DEFAULT_ROOT) / "train-labels-idx1-ubyte.gz").is_file()
RESNET: dict[str, Any] = DEFAULT_MODELS["resnet"]
MLP: dict[str, Any] = {"hidden": [16]}


def _stream(name: str, kwargs: dict[str, Any], **options: Any) -> tuple[Any, str]:
    model = build_model(name, **kwargs)
    defaults: dict[str, Any] = {
        "data": "real",
        "root": DEFAULT_ROOT,
        "batch_size": 8,
        "seed": 0,
        "rank": 0,
        "world_size": 2,
    }
    return bench_batches(model, name, kwargs, **{**defaults, **options})


def test_the_bench_image_models_take_fashion_mnist_and_language_models_do_not() -> None:
    assert real_data_fits(build_model("resnet", **RESNET), "resnet", RESNET)
    assert real_data_fits(build_model("mlp", **MLP), "mlp", MLP)
    assert not real_data_fits(build_model("gpt"), "gpt", {})
    seven_way = {**RESNET, "num_classes": 7}
    assert not real_data_fits(build_model("resnet", **seven_way), "resnet", seven_way)


def test_probe_leaves_the_model_in_training_mode_and_its_bn_stats_unchanged() -> None:
    model = build_model("resnet", **RESNET)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert real_data_fits(model, "resnet", RESNET) and model.training
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.skipif(not HAVE_FASHION, reason="dataset-fashion-mnist not installed")
def test_real_batches_are_fashion_mnist_disjoint_across_ranks_and_reproducible() -> None:
    batches0, used0 = _stream("resnet", RESNET, rank=0)
    batches1, used1 = _stream("resnet", RESNET, rank=1)
    assert used0 == used1 == "real"
    x0, y0 = next(batches0)
    x1, y1 = next(batches1)
    assert x0.shape == (8, 1, 28, 28) and y0.dtype == torch.int64
    assert int(y0.min()) >= 0 and int(y0.max()) < 10
    rows0 = {tuple(row.flatten().tolist()) for row in x0}
    assert not rows0 & {tuple(row.flatten().tolist()) for row in x1}  # a distributed sampler
    again, _ = _stream("resnet", RESNET, rank=0)
    assert torch.equal(next(again)[0], x0)


def test_random_when_asked_absent_or_not_fitting(caplog: pytest.LogCaptureFixture) -> None:
    batches, used = _stream("resnet", RESNET, data="random")
    assert used == "random" and next(batches)[0].shape == (8, 1, 28, 28)
    with caplog.at_level(logging.WARNING, logger="superneurons.bench.network"):
        _, absent = _stream("resnet", RESNET, root="/nonexistent/fashion")
        _, lm = _stream("gpt", {})
    assert absent == lm == "random"
    assert "no Fashion-MNIST" in caplog.text and "does not take" in caplog.text
    with pytest.raises(ConfigError, match="data must be one of"):
        _stream("resnet", RESNET, data="imagenet")
    with pytest.raises(ConfigError, match="--data"):
        NetworkBenchConfig(data="imagenet")
