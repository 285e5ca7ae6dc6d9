"""A tiny Fashion-MNIST in the real IDX format, written where a test wants it, so training
and data tests need neither the installed dataset nor its load time."""

from __future__ import annotations

import gzip
from pathlib import Path

import torch

__all__ = ["write_fashion_mnist"]

_STEMS = {"train": "train", "test": "t10k"}


def _idx_bytes(array: torch.Tensor) -> bytes:
    header = bytes([0, 0, 0x08, array.dim()])  # 0x08: unsigned bytes
    header += b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.numpy().tobytes()


def write_fashion_mnist(
    root: Path, *, n_train: int = 128, n_test: int = 32, gz: bool = True
) -> Path:
    """Write random images and labels as the four Fashion-MNIST files under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    for split, n in (("train", n_train), ("test", n_test)):
        images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=generator)
        labels = torch.randint(0, 10, (n,), dtype=torch.uint8, generator=generator)
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            raw = _idx_bytes(array)
            stem = f"{_STEMS[split]}-{kind}-ubyte"
            if gz:
                (root / f"{stem}.gz").write_bytes(gzip.compress(raw))
            else:
                (root / stem).write_bytes(raw)
    return root
