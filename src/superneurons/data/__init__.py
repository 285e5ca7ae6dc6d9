"""Dataset loaders reading standard formats from a directory, and a character tokenizer with a
corpus of word texts built in code (no downloads)."""

from __future__ import annotations

from superneurons.data.catalog import DATASET_NAMES, build_dataset
from superneurons.data.chars import char_tokenizer, word_texts
from superneurons.data.fashion_mnist import fashion_mnist, read_idx
from superneurons.data.shakespeare import ShakespeareDataset, Vocab, load_corpus, shakespeare

__all__ = [
    "DATASET_NAMES",
    "ShakespeareDataset",
    "Vocab",
    "build_dataset",
    "char_tokenizer",
    "fashion_mnist",
    "load_corpus",
    "read_idx",
    "shakespeare",
    "word_texts",
]
