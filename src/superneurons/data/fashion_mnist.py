"""Fashion-MNIST (Xiao, Rasul & Vollgraf, 2017) from its IDX files; no downloads.

The IDX format (LeCun's MNIST format): a big-endian magic number ``0x00 0x00 <dtype> <ndim>``,
``ndim`` big-endian uint32 dimensions, then the raw data. Fashion-MNIST uses unsigned bytes
(dtype ``0x08``): images are ``idx3`` (N, 28, 28), labels ``idx1`` (N,). Files may be gzipped.
On Debian the package ``dataset-fashion-mnist`` installs them under
``/usr/share/datasets/fashion-mnist``.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from superneurons.errors import ConfigError, DataError

__all__ = ["FASHION_MNIST_MEAN", "FASHION_MNIST_STD", "fashion_mnist", "read_idx"]

DEFAULT_ROOT = "/usr/share/datasets/fashion-mnist"
# Per-pixel mean and std of the 60k training images after scaling to [0, 1] (computed from the
# training set; the usual published values).
FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530
_IDX_DTYPES: dict[int, torch.dtype] = {
    0x08: torch.uint8,
    0x09: torch.int8,
    0x0B: torch.int16,
    0x0C: torch.int32,
    0x0D: torch.float32,
    0x0E: torch.float64,
}
# What to do about a bad file, appended to every message about one.
_REPLACE_HINT = (
    "replace it (apt-get install --reinstall dataset-fashion-mnist, or `bash scripts/setup.sh`)"
)
_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_idx(path: str | Path) -> torch.Tensor:
    """Read one IDX file (optionally ``.gz``) into a tensor of its stored dtype and shape.

    Raises:
        DataError: the file is missing or unreadable (e.g. a truncated ``.gz``), has a bad magic
            number or dtype code, or holds fewer or more bytes than its header says.
    """
    path = Path(path)
    raw = _read_bytes(path)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DataError(
            f"{path}: not an IDX file (magic must start with two zero bytes); {_REPLACE_HINT}"
        )
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise DataError(f"{path}: unknown IDX dtype code 0x{code:02x}; {_REPLACE_HINT}")
    header_bytes = 4 + 4 * ndim
    if len(raw) < header_bytes:
        raise DataError(f"{path}: truncated IDX header; {_REPLACE_HINT}")
    shape = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    dtype = _IDX_DTYPES[code]
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for dim in shape:
        numel *= dim
    if len(raw) - header_bytes != numel * itemsize:
        raise DataError(
            f"{path}: IDX header says shape {shape} ({numel * itemsize} bytes) but the file "
            f"holds {len(raw) - header_bytes} data bytes (truncated or corrupt); {_REPLACE_HINT}"
        )
    data = torch.frombuffer(bytearray(raw[header_bytes:]), dtype=dtype) if numel else None
    if data is None:
        return torch.empty(shape, dtype=dtype)
    if itemsize > 1:  # IDX is big-endian
        data = torch.from_numpy(data.numpy().byteswap())
    return data.reshape(shape)


def _read_bytes(path: Path) -> bytes:
    """The (decompressed) bytes of ``path``; any read failure is one :class:`DataError`."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            return bytes(handle.read())
    except FileNotFoundError:
        raise DataError(f"{path}: no such file; {_REPLACE_HINT}") from None
    # NOTE: a truncated gzip stream raises EOFError, a damaged one gzip.BadGzipFile (an OSError)
    # or zlib.error; none of them names the file.
    except (EOFError, OSError, zlib.error) as exc:
        reason = str(exc).strip() or type(exc).__name__
        raise DataError(
            f"{path}: cannot be read ({reason}): the file is truncated or corrupt; {_REPLACE_HINT}"
        ) from None


def _find(root: Path, stem: str) -> Path:
    if not root.is_dir():
        raise DataError(
            f"Fashion-MNIST directory {root} does not exist: install the Debian package "
            f"dataset-fashion-mnist (apt-get install dataset-fashion-mnist) or run "
            f"`bash scripts/setup.sh`, or pass root= the directory holding the IDX files"
        )
    for candidate in (root / f"{stem}.gz", root / stem):
        if candidate.is_file():
            return candidate
    raise DataError(
        f"Fashion-MNIST file {stem}(.gz) not found in {root}: install the Debian package "
        f"dataset-fashion-mnist (apt-get install dataset-fashion-mnist) or run "
        f"`bash scripts/setup.sh`, or pass root= the directory holding the IDX files"
    )


def fashion_mnist(root: str | Path = DEFAULT_ROOT, split: str = "train") -> TensorDataset:
    """Fashion-MNIST as a ``TensorDataset`` of ``(N, 1, 28, 28)`` float32 images normalised with
    the training-set mean/std and ``(N,)`` int64 labels (60000 train, 10000 test)."""
    if split not in _FILES:
        raise ConfigError(f"fashion-mnist: split must be one of {sorted(_FILES)}, got {split!r}")
    root = Path(root)
    image_stem, label_stem = _FILES[split]
    image_path, label_path = _find(root, image_stem), _find(root, label_stem)
    images, labels = read_idx(image_path), read_idx(label_path)
    if images.dim() != 3 or labels.dim() != 1 or images.shape[0] != labels.shape[0]:
        raise DataError(
            f"fashion-mnist: expected images (N, H, W) in {image_path} and labels (N,) in "
            f"{label_path}, got {tuple(images.shape)} and {tuple(labels.shape)}; {_REPLACE_HINT}"
        )
    x = images.to(torch.float32).div_(255.0).sub_(FASHION_MNIST_MEAN).div_(FASHION_MNIST_STD)
    return TensorDataset(x.unsqueeze(1), labels.to(torch.int64))  # (N, 1, H, W), (N,)
