"""Which model trains on which dataset, and how: the (model × data) table of the trainer.

Fashion-MNIST (Xiao et al. 2017) trains the image classifiers at 28×28×1 with 10 classes;
character-level Shakespeare (Karpathy's char-rnn task) trains the language models, whose
vocabulary comes from the corpus. Sizes are chosen so one epoch runs on a laptop CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from superneurons.errors import ConfigError

__all__ = ["TASKS", "Task", "build_task", "check_task"]

# NOTE: a literal table (model, data) -> builder keyword arguments; the whole matrix is here.
TASKS: dict[tuple[str, str], dict[str, Any]] = {
    ("mlp", "fashion-mnist"): {},
    ("fc-heavy", "fashion-mnist"): {},
    ("resnet", "fashion-mnist"): {
        "layers": (2, 2, 2, 2),
        "block": "basic",
        "width": 16,
        "small_input": True,
        "in_channels": 1,
        "num_classes": 10,
    },
    ("alexnet", "fashion-mnist"): {"in_channels": 1, "image_size": 28, "num_classes": 10},
    ("gpt", "shakespeare"): {"n_layer": 4, "n_head": 4, "n_embd": 128, "dropout": 0.0},
    ("lstm", "shakespeare"): {},
}
_TEST_SPLIT = {"fashion-mnist": "test", "shakespeare": "val"}
_LANGUAGE_DATA = frozenset({"shakespeare"})


@dataclass
class Task:
    """A model with its train/test data and its loss (``loss_fn(output, targets)``)."""

    model: nn.Module
    train_set: Dataset[Any]
    test_set: Dataset[Any]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    is_language_model: bool


def check_task(model: str, data: str) -> None:
    """Raise :class:`ConfigError` for a (model, data) pair the trainer does not know."""
    if (model, data) not in TASKS:
        pairs = ", ".join(f"{m} on {d}" for m, d in TASKS)
        raise ConfigError(f"cannot train --model {model} on --data {data}; supported: {pairs}")


def build_task(model: str, data: str, *, data_dir: str | None, block_size: int) -> Task:
    """Build the model (same initialisation on every rank: seed first) and its datasets."""
    from superneurons.data import build_dataset
    from superneurons.models import build_model, default_loss

    check_task(model, data)
    data_kw: dict[str, Any] = {} if data_dir is None else {"root": data_dir}
    model_kw = dict(TASKS[(model, data)])
    if data in _LANGUAGE_DATA:
        data_kw["block_size"] = block_size
    train_set = build_dataset(data, "train", **data_kw)
    test_set = build_dataset(data, _TEST_SPLIT[data], **data_kw)
    if data in _LANGUAGE_DATA:
        model_kw["vocab_size"] = len(train_set.vocab)  # type: ignore[attr-defined]
        if model == "gpt":
            model_kw["block_size"] = block_size
    return Task(
        model=build_model(model, **model_kw),
        train_set=train_set,
        test_set=test_set,
        loss_fn=default_loss(model),
        is_language_model=data in _LANGUAGE_DATA,
    )
