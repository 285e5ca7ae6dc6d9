"""The foundation: byte sizes, bit-packing, the CLI's error contract, import hygiene."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from superneurons import ConfigError, format_bytes, parse_bytes
from superneurons.cli import main
from superneurons.codecs.coding.bitpack import pack_bits, packed_bytes, unpack_bits


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12GiB", 12 * 1024**3),
        ("12g", 12 * 1024**3),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        ("512 MiB", 512 * 1024**2),
        (77, 77),
    ],
)
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "twelve", "12XB", "0", "-3GiB", "0GiB"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_bytes(text)


def test_format_bytes() -> None:
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(12 * 1024**3) == "12.00 GiB"


@pytest.mark.parametrize("bits", list(range(1, 17)))
@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 13, 1001])
def test_bitpack_roundtrip_and_exact_size(bits: int, count: int) -> None:
    codes = torch.randint(0, 2**bits, (count,))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_bytes(count, bits) == (count * bits + 7) // 8
    assert torch.equal(unpack_bits(packed, bits, count), codes)


def test_bitpack_rejects_bad_width() -> None:
    with pytest.raises(ConfigError):
        pack_bits(torch.zeros(3, dtype=torch.int64), 0)


def test_cli_bad_flag_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--no-such-flag"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) <= 2 and "--help" in err


def test_import_touches_no_cuda_and_prints_nothing() -> None:
    code = (
        "import torch, superneurons; "
        "assert not torch.cuda.is_initialized(); "
        "import superneurons.cli"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == ""


def test_unpack_16_bit_from_odd_offset() -> None:
    codes = torch.randint(0, 2**16, (5,))
    data = torch.cat([torch.zeros(1, dtype=torch.uint8), pack_bits(codes, 16)])
    assert torch.equal(unpack_bits(data[1:], 16, 5), codes)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_all_finite_detects_every_non_finite_value(bad: float) -> None:
    from superneurons.codecs.coding.finite import all_finite

    values = torch.randn(1001)
    assert all_finite(values) and all_finite(torch.zeros(0))
    assert all_finite(torch.full((3,), 3e38))  # large but finite: no overflow false alarm
    values[500] = bad
    assert not all_finite(values)
