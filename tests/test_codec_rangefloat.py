"""Range-float quantizer (HPDC'20): per-element error bounds, exponent rule, wire contract."""

from __future__ import annotations

import math

import pytest
import torch

from superneurons.codecs.codec import Codec, sum_of_decodes
from superneurons.codecs.coding.rangefloat import (
    HEADER_BYTES,
    SUPPORTED_BITS,
    RangeFloatHeader,
    dequantize,
    exponent_bits_for_range,
    quantize,
)
from superneurons.codecs.rangefloat import RangeFloatCodec
from superneurons.errors import ConfigError

SIZES = (1, 2, 3, 7, 97, 1000, 4097, 2**20)


def _samples(n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    normal = torch.randn(n, generator=gen)
    sparse = torch.zeros(n)
    sparse[torch.randint(n, (n // 50,), generator=gen)] = torch.randn(n // 50, generator=gen)
    return {
        "normal": normal,
        "heavy": normal**3 * 1e-3,  # heavy-tailed, small scale
        "wide": torch.exp(torch.randn(n, generator=gen) * 6.0) * torch.sign(normal),
        "sparse": sparse,
        "tiny": normal * 1e-20,
    }


def _window(header: RangeFloatHeader, bits: int) -> tuple[int, int]:
    """(mantissa bits, exponent of the window's lowest normal binade)."""
    mant = bits - 1 - header.exp_bits
    top = math.frexp(float(header.max_abs))[1] - 1
    return mant, max(top - 2**header.exp_bits + 2, -125)


@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("use_threshold", [False, True])
def test_error_bound_per_element(bits: int, use_threshold: bool) -> None:
    for name, values in _samples(20_000).items():
        threshold = float(values.abs().max()) * 1e-3 if use_threshold else None
        codes, header = quantize(values, bits, threshold=threshold)
        restored = dequantize(codes, header, bits)
        mant, low_exp = _window(header, bits)
        mag = values.abs()
        err = (restored - values).abs()
        inside = mag >= 2.0**low_exp
        # Round to nearest: half an ulp; at the saturated top code at most 2**-m / (2 - 2**-m).
        rel_bound = 2.0 ** -(mant + 1) * (1 + 2.0**-mant)
        assert bool((err[inside] <= rel_bound * mag[inside]).all()), name
        step = 2.0 ** (low_exp - mant)
        assert bool((err[~inside] <= step / 2).all()), name
        # Signs never flip; zero stays zero.
        assert bool((restored * values >= 0).all()), name
        assert bool((restored[values == 0] == 0).all()), name


def test_exponent_bits_follow_the_range_rule() -> None:
    # ceil(log2(binades + 1)) with binades = floor(log2 max) - floor(log2 thr) + 1
    assert exponent_bits_for_range(1.0, 1.0, 8) == 1  # one binade
    assert exponent_bits_for_range(1.0, 0.25, 8) == 2  # three binades
    assert exponent_bits_for_range(1.0, 2.0**-6, 8) == 3  # seven binades
    assert exponent_bits_for_range(1.0, 2.0**-7, 8) == 4  # eight binades
    assert exponent_bits_for_range(1.0, 1e-30, 8) == 5  # capped: >= 2 mantissa bits remain
    values = torch.tensor([1.0, -0.3, 2.0**-6])
    _, header = quantize(values, 8, threshold=2.0**-6)
    assert header.exp_bits == 3


def test_value_sets_in_the_window_round_trip_exactly() -> None:
    # Every representable value decodes to itself: quantize(dequantize(codes)) is a fixed point.
    codes = torch.arange(256, dtype=torch.int32)
    header = RangeFloatHeader.of(3.5, 3)
    grid = dequantize(codes, header, 8)
    again, header2 = quantize(grid, 8, threshold=2.0**-5)  # max in [2, 4): 7 binades, e = 3
    assert header2.exp_bits == 3
    torch.testing.assert_close(dequantize(again, header2, 8), grid, rtol=0, atol=0)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_payload_bytes_equal_encoded_bytes(bits: int) -> None:
    codec = RangeFloatCodec(bits=bits)
    for n in SIZES:
        payload = codec.encode(torch.randn(n))
        assert payload.data.dtype == torch.uint8
        assert payload.nbytes == codec.payload_bytes(n)
        expected = 4 * n if bits == 32 else HEADER_BYTES + math.ceil(n * bits / 8)
        assert codec.payload_bytes(n) == expected


def test_bits32_is_lossless_and_bits8_is_close() -> None:
    values = _samples(5000)["normal"]
    torch.testing.assert_close(
        RangeFloatCodec(bits=32).decode(RangeFloatCodec(bits=32).encode(values)),
        values,
        rtol=0,
        atol=0,
    )
    codec = RangeFloatCodec(bits=8)
    restored = codec.decode(codec.encode(values))
    assert restored.dtype == torch.float32
    header = RangeFloatHeader.from_bytes(codec.encode(values).data[:HEADER_BYTES])
    mant, _ = _window(header, 8)
    # L2 error below the per-element bound of the window plus the flushed tail.
    assert float((restored - values).norm() / values.norm()) <= 2.0 ** -(mant + 1) * 1.5


def test_decode_sum_equals_sum_of_decodes() -> None:
    codec = RangeFloatCodec(bits=8)
    payloads = [codec.encode(torch.randn(999) * (r + 1)) for r in range(4)]
    torch.testing.assert_close(codec.decode_sum(payloads), sum_of_decodes(codec, payloads))


def test_protocol_and_spec() -> None:
    codec = RangeFloatCodec()
    assert isinstance(codec, Codec)
    assert codec.spec == "rangefloat:bits=8"
    assert RangeFloatCodec(bits=4).spec == "rangefloat:bits=4"
    assert codec.summable is False
    assert RangeFloatCodec.NAME == "rangefloat"


@pytest.mark.parametrize("bits", [0, 3, 7, 33, True])
def test_unsupported_bits_name_the_supported_ones(bits: int) -> None:
    with pytest.raises(ConfigError, match=r"\[4, 8, 16, 32\]"):
        RangeFloatCodec(bits=bits)


def test_bad_inputs_raise_config_error() -> None:
    codec = RangeFloatCodec()
    with pytest.raises(ConfigError, match="floating point"):
        codec.encode(torch.arange(10))
    with pytest.raises(ConfigError, match="empty"):
        codec.encode(torch.zeros(0))
    with pytest.raises(ConfigError, match="expected"):
        codec.decode(RangeFloatCodec(bits=4).encode(torch.randn(100)))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_non_finite_input_decodes_to_all_nan(bad: float, bits: int) -> None:
    codec = RangeFloatCodec(bits=bits)
    values = torch.randn(100)
    values[17] = bad
    payload = codec.encode(values)  # never raises
    assert payload.nbytes == codec.payload_bytes(100)
    decoded = codec.decode(payload)
    if bits == 32:  # raw floats carry the non-finite value itself, as a dense all-reduce would
        assert not bool(torch.isfinite(decoded).all())
    else:
        assert bool(torch.isnan(decoded).all())
    good = codec.encode(torch.randn(100))
    assert not bool(torch.isfinite(codec.decode_sum([good, payload])).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype: torch.dtype) -> None:
    values = torch.randn(4096).to(dtype)
    codec = RangeFloatCodec(bits=8)
    decoded = codec.decode(codec.encode(values))
    reference = codec.decode(codec.encode(values.float()))
    assert decoded.dtype == torch.float32
    torch.testing.assert_close(decoded, reference, rtol=0, atol=0)


def test_all_zero_and_single_element() -> None:
    codec = RangeFloatCodec()
    assert bool((codec.decode(codec.encode(torch.zeros(33))) == 0).all())
    one = codec.decode(codec.encode(torch.tensor([-0.75])))
    assert float(one[0]) == -0.75


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_quantize_rounds_to_the_nearest_representable_value(bits: int) -> None:
    # Implementation-independent check of the branch-free integer code path: the grid of all
    # representable magnitudes comes from dequantize, and every value must land on a nearest
    # grid point (ties may go either way).
    for name, values in _samples(20_000).items():
        codes, header = quantize(values, bits, threshold=None)
        grid = dequantize(torch.arange(2 ** (bits - 1), dtype=torch.int32), header, bits)
        grid = grid.double()
        assert bool((grid[1:] > grid[:-1]).all()), name  # strictly increasing magnitudes
        mag = values.double().abs()
        upper = torch.searchsorted(grid, mag).clamp(max=grid.numel() - 1)
        lower = (upper - 1).clamp(min=0)
        nearest = torch.minimum((grid[upper] - mag).abs(), (mag - grid[lower]).abs())
        got = (dequantize(codes, header, bits).double().abs() - mag).abs()
        torch.testing.assert_close(got, nearest, rtol=0, atol=0, msg=name)


def test_quantize_and_codec_leave_their_inputs_untouched() -> None:
    values = _samples(3000)["wide"]
    before = values.clone()
    codes, header = quantize(values, 8)
    codes_before = codes.clone()
    dequantize(codes, header, 8)
    assert torch.equal(values, before)
    assert torch.equal(codes, codes_before)
    codec = RangeFloatCodec(bits=8)
    payload = codec.encode(values)
    data = payload.data.clone()
    codec.decode(payload)
    assert torch.equal(values, before)
    assert torch.equal(payload.data, data)
