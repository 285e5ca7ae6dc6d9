"""Dataset loaders reading standard formats from a directory (no downloads)."""

from __future__ import annotations

from superneurons.data.catalog import DATASET_NAMES, build_dataset
from superneurons.data.fashion_mnist import fashion_mnist, read_idx
from superneurons.data.shakespeare import ShakespeareDataset, Vocab, load_corpus, shakespeare

__all__ = [
    "DATASET_NAMES",
    "ShakespeareDataset",
    "Vocab",
    "build_dataset",
    "fashion_mnist",
    "load_corpus",
    "read_idx",
    "shakespeare",
]
