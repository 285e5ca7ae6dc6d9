"""What the network benchmark trains on: Fashion-MNIST where the model takes it, else random.

The bench first trained on random images and labels (``models.model_input``). Their
gradients are nearly full rank: on the bench's ResNet, PowerSGD rank 4's one-shot relative
error is 0.88-0.91 on them against 0.74 on Fashion-MNIST (benchmarks/results/network/auto/
README.md, the error budget's calibration). ``auto`` judges candidates by that error, so on random data its
budget, calibrated on real training, saw gradients no user trains on. ``data="real"`` feeds
Fashion-MNIST (Xiao, Rasul & Vollgraf, 2017) to every model whose input is one 28x28 channel
with 10 classes (the bench's ``fc-heavy`` and ``resnet``); any other model, or a machine
without the dataset, keeps the random batches, with a logged note and ``data: "random"`` in
its record.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from superneurons.errors import ConfigError, DataError

__all__ = ["DATA_CHOICES", "bench_batches", "real_data_fits"]

logger = logging.getLogger("superneurons.bench.network")

DATA_CHOICES: tuple[str, ...] = ("real", "random")
_FASHION_SHAPE = (1, 28, 28)
_FASHION_CLASSES = 10


def real_data_fits(model: nn.Module, name: str, model_kwargs: dict[str, Any]) -> bool:
    """Whether ``model`` takes Fashion-MNIST as it is: (1, 28, 28) images, 10 classes."""
    from superneurons.models import model_input

    x, y = model_input(name, 2, generator=torch.Generator().manual_seed(0), **model_kwargs)
    if tuple(x.shape[1:]) != _FASHION_SHAPE or not x.is_floating_point() or y.dim() != 1:
        return False
    was_training = model.training
    model.eval()  # NOTE: no batch statistics or running-stat updates from this probe
    try:
        with torch.no_grad():
            out = model(x)
    finally:
        model.train(was_training)
    return tuple(out.shape) == (2, _FASHION_CLASSES)


def bench_batches(
    model: nn.Module,
    name: str,
    model_kwargs: dict[str, Any],
    *,
    data: str,
    root: str,
    batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
) -> tuple[Iterator[tuple[torch.Tensor, torch.Tensor]], str]:
    """``(batches, data used)``: an endless batch stream for this rank and ``"real"`` or
    ``"random"`` (what the record states).

    Real: every rank walks one shared permutation of the 60000 training images (seeded by
    ``seed``, a new one each epoch) and takes every ``world_size``-th batch from ``rank`` on,
    so the ranks see disjoint samples as a distributed sampler gives them. Random: the zoo's
    random batches, a different stream on every rank (the old default).

    Raises:
        ConfigError: ``data`` is not one of :data:`DATA_CHOICES`.
    """
    if data not in DATA_CHOICES:
        raise ConfigError(f"data must be one of {DATA_CHOICES}, got {data!r}")
    if data == "real":
        if not real_data_fits(model, name, model_kwargs):
            logger.warning("bench network: %s does not take Fashion-MNIST; random batches", name)
        else:
            from superneurons.data import fashion_mnist

            try:
                images, labels = fashion_mnist(root, "train").tensors
            except DataError as exc:
                logger.warning("bench network: no Fashion-MNIST (%s); random batches", exc)
            else:
                return _real(images, labels, batch_size, seed, rank, world_size), "real"
    return _random(name, model_kwargs, batch_size, seed, rank), "random"


def _random(
    name: str, model_kwargs: dict[str, Any], batch_size: int, seed: int, rank: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    from superneurons.models import model_input

    gen = torch.Generator().manual_seed(seed + 1 + rank)
    while True:
        yield model_input(name, batch_size, generator=gen, **model_kwargs)


def _real(
    images: torch.Tensor,
    labels: torch.Tensor,
    batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    per_epoch = images.shape[0] // (batch_size * world_size)
    epoch = 0
    while True:
        order = torch.randperm(
            images.shape[0], generator=torch.Generator().manual_seed(seed + epoch)
        )
        for step in range(per_epoch):
            at = (step * world_size + rank) * batch_size
            idx = order[at : at + batch_size]
            yield images[idx], labels[idx]
        epoch += 1
