"""The dataset names the CLI and benchmarks use, mapped to their loaders."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset

from superneurons.data.fashion_mnist import fashion_mnist
from superneurons.data.shakespeare import shakespeare
from superneurons.errors import ConfigError

__all__ = ["DATASET_NAMES", "build_dataset"]

_LOADERS: dict[str, Callable[..., Dataset[Any]]] = {
    "fashion-mnist": fashion_mnist,
    "shakespeare": shakespeare,
}
DATASET_NAMES: tuple[str, ...] = tuple(_LOADERS)


def build_dataset(name: str, split: str = "train", **kwargs: Any) -> Dataset[Any]:
    """``fashion-mnist`` (splits train/test, ``root=``) or ``shakespeare`` (splits train/val,
    ``root=``, ``block_size=``)."""
    if name not in _LOADERS:
        raise ConfigError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASET_NAMES)}")
    try:
        return _LOADERS[name](split=split, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"dataset {name!r}: {exc}") from exc
