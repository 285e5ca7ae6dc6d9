"""Dataset loaders: IDX parsing on tiny files written here, the real files when installed, the
Shakespeare char dataset, and the error messages."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch

from superneurons.data import build_dataset, fashion_mnist, read_idx, shakespeare
from superneurons.data.fashion_mnist import DEFAULT_ROOT
from superneurons.errors import ConfigError, DataError


def _idx_bytes(array: torch.Tensor, code: int = 0x08) -> bytes:
    header = bytes([0, 0, code, array.dim()])
    header += b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.numpy().astype(array.numpy().dtype.newbyteorder(">")).tobytes()


def _write_split(root: Path, prefix: str, n: int, *, gz: bool) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8)
    labels = torch.randint(0, 10, (n,), dtype=torch.uint8)
    for stem, array in (
        (f"{prefix}-images-idx3-ubyte", images),
        (f"{prefix}-labels-idx1-ubyte", labels),
    ):
        raw = _idx_bytes(array)
        if gz:
            (root / f"{stem}.gz").write_bytes(gzip.compress(raw))
        else:
            (root / stem).write_bytes(raw)
    return images, labels


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_reads_idx(tmp_path: Path, gz: bool) -> None:
    images, labels = _write_split(tmp_path, "t10k", 5, gz=gz)
    dataset = fashion_mnist(tmp_path, split="test")
    x, y = dataset.tensors
    assert x.shape == (5, 1, 28, 28) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and torch.equal(y, labels.long())
    # Normalisation is affine and order-preserving in the raw pixel value.
    flat_raw, flat_x = images.flatten().float(), x.flatten()
    assert torch.equal(torch.argsort(flat_raw, stable=True), torch.argsort(flat_x, stable=True))


def test_read_idx_big_endian_multibyte(tmp_path: Path) -> None:
    array = torch.arange(-6, 6, dtype=torch.int32).reshape(3, 4) * 1000
    (tmp_path / "x.idx").write_bytes(_idx_bytes(array, code=0x0C))
    assert torch.equal(read_idx(tmp_path / "x.idx"), array)


def test_read_idx_rejects_bad_files(tmp_path: Path) -> None:
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01" + (3).to_bytes(4, "big") + b"abc")
    with pytest.raises(ConfigError, match="magic"):
        read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(b"\x00\x00\x08\x01" + (9).to_bytes(4, "big") + b"abc")
    with pytest.raises(ConfigError, match="header says"):
        read_idx(tmp_path / "short")


def test_missing_files_name_the_package(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dataset-fashion-mnist.*scripts/setup.sh"):
        fashion_mnist(tmp_path)
    with pytest.raises(ConfigError, match="split"):
        fashion_mnist(tmp_path, split="validation")


@pytest.mark.skipif(not Path(DEFAULT_ROOT).is_dir(), reason="dataset-fashion-mnist not installed")
def test_real_fashion_mnist_test_split() -> None:
    x, y = fashion_mnist(split="test").tensors
    assert x.shape == (10_000, 1, 28, 28)
    assert set(y.unique().tolist()) == set(range(10))
    assert abs(float(x.mean())) < 0.1  # normalised with the training statistics


def test_shakespeare_blocks_and_vocab(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("to be, or not to be?\n", encoding="utf-8")
    (tmp_path / "a.txt").write_text("Now is the winter\n", encoding="utf-8")
    train = shakespeare(tmp_path, block_size=4, split="train")
    val = shakespeare(tmp_path, block_size=2, split="val")
    text = "Now is the winter\nto be, or not to be?\n"  # sorted file order
    assert train.vocab.itos == tuple(sorted(set(text)))
    assert train.vocab.decode(train.vocab.encode(text)) == text
    x, y = train[1]
    assert train.vocab.decode(x) == text[4:8] and train.vocab.decode(y) == text[5:9]
    assert len(train) == (int(len(text) * 0.9) - 1) // 4
    assert val.vocab == train.vocab and len(val) >= 1
    dataset = build_dataset("shakespeare", "train", root=tmp_path, block_size=4)
    assert torch.equal(dataset[0][0], x.new_tensor(train.vocab.encode(text[:4])))


def test_shakespeare_and_catalog_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="scripts/setup.sh"):
        shakespeare(tmp_path)
    with pytest.raises(ConfigError, match="choose one of: fashion-mnist, shakespeare"):
        build_dataset("cifar10")


@pytest.mark.parametrize("gz", [True, False])
def test_truncated_idx_files_name_the_file(tmp_path: Path, gz: bool) -> None:
    _write_split(tmp_path, "t10k", 5, gz=gz)
    path = tmp_path / ("t10k-images-idx3-ubyte" + (".gz" if gz else ""))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DataError, match=f"{path}: .*truncated or corrupt.*replace it") as info:
        fashion_mnist(tmp_path, split="test")
    assert "\n" not in str(info.value)


def test_missing_directories_and_unreadable_texts_are_data_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        fashion_mnist(tmp_path / "nowhere")
    with pytest.raises(DataError, match="does not exist"):
        shakespeare(tmp_path / "nowhere")
    (tmp_path / "a.txt").mkdir()  # a directory where a text file should be
    (tmp_path / "b.txt").write_text("to be\n", encoding="utf-8")
    with pytest.raises(DataError, match="a.txt: cannot be read"):
        shakespeare(tmp_path)
