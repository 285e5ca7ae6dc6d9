"""The codec contract, checked for every codec name in ``spec.CODECS`` (paper codecs included).

``payload_bytes`` is the exact wire size and depends only on numel; decode gives float32 of the
right length; ``decode_sum`` equals the sum of decodes; stochastic codecs are reproducible from a
generator; bad inputs raise ConfigError; non-finite inputs follow the project-wide NaN policy.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from superneurons.compress import CODECS, Codec, Payload, parse_spec, sum_of_decodes
from superneurons.errors import ConfigError

NAMES = list(CODECS)
SIZES = [1, 2, 3, 7, 97, 1000, 4097]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _codec(name: str) -> Codec:
    return CODECS[name]()


@pytest.mark.parametrize("name", NAMES)
def test_payload_bytes_is_exact_for_every_size_and_dtype(name: str) -> None:
    codec = _codec(name)
    assert isinstance(codec, Codec)
    for numel in SIZES:
        for dtype in DTYPES:
            grad = torch.randn(numel).to(dtype)
            payload = codec.encode(grad, generator=torch.Generator().manual_seed(numel))
            assert payload.numel == numel
            assert payload.data.dim() == 1 and payload.data.is_contiguous()
            assert payload.nbytes == codec.payload_bytes(numel), (name, numel, dtype)
            if not codec.summable:
                assert payload.data.dtype == torch.uint8
            decoded = codec.decode(payload)
            assert decoded.dtype == torch.float32 and decoded.shape == (numel,)
            assert bool(torch.isfinite(decoded).all())


@pytest.mark.parametrize("name", NAMES)
def test_payload_size_does_not_depend_on_values(name: str) -> None:
    codec = _codec(name)
    numel = 513
    sizes = {
        codec.encode(values).nbytes
        for values in (
            torch.zeros(numel),
            torch.full((numel,), 3.0),
            torch.randn(numel) * 1e-30,
            torch.randn(numel) * 1e4,
            torch.arange(numel, dtype=torch.float32),
        )
    }
    assert sizes == {codec.payload_bytes(numel)}


@pytest.mark.parametrize("name", NAMES)
def test_zero_gradient_decodes_to_zero(name: str) -> None:
    codec = _codec(name)
    decoded = codec.decode(codec.encode(torch.zeros(300)))
    assert torch.equal(decoded, torch.zeros(300))


@pytest.mark.parametrize("name", NAMES)
def test_decode_sum_equals_sum_of_decodes(name: str) -> None:
    codec = _codec(name)
    gen = torch.Generator().manual_seed(1)
    payloads = [codec.encode(torch.randn(777), generator=gen) for _ in range(3)]
    torch.testing.assert_close(
        codec.decode_sum(payloads), sum_of_decodes(codec, payloads), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("name", NAMES)
def test_encode_is_reproducible_from_a_generator(name: str) -> None:
    codec = _codec(name)
    grad = torch.randn(5000)
    first = codec.encode(grad, generator=torch.Generator().manual_seed(7))
    second = codec.encode(grad, generator=torch.Generator().manual_seed(7))
    assert torch.equal(first.data, second.data)


@pytest.mark.parametrize("name", NAMES)
def test_spec_round_trips_and_codec_is_frozen(name: str) -> None:
    codec = _codec(name)
    assert codec.spec.split(":")[0] == name
    assert parse_spec(codec.spec) == codec
    fields = dataclasses.fields(codec)  # type: ignore[arg-type]
    if fields:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(codec, fields[0].name, getattr(codec, fields[0].name))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "bad",
    [torch.zeros(0), torch.zeros((0, 3)), torch.arange(10), torch.ones(4, dtype=torch.bool)],
    ids=["empty", "empty-2d", "int64", "bool"],
)
def test_rejects_empty_and_non_float_input(name: str, bad: torch.Tensor) -> None:
    with pytest.raises(ConfigError, match=name):
        _codec(name).encode(bad)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad_value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_nan_policy(name: str, bad_value: float) -> None:
    """encode never raises on values; non-finite input decodes non-finite (all-NaN for codecs
    with a shared header; element-wise for the cast codecs)."""
    codec = _codec(name)
    grad = torch.randn(1000)
    grad[123] = bad_value
    payload = codec.encode(grad, generator=torch.Generator().manual_seed(0))
    assert payload.nbytes == codec.payload_bytes(1000)
    decoded = codec.decode(payload)
    if codec.summable:
        assert torch.equal(torch.isfinite(decoded), torch.isfinite(grad))
        assert (decoded[123] == bad_value) or (math.isnan(bad_value) and bool(decoded[123].isnan()))
    else:
        assert bool(decoded.isnan().all())
        good = codec.encode(torch.randn(1000))
        assert bool(codec.decode_sum([good, payload, good]).isnan().all())


@pytest.mark.parametrize("name", NAMES)
def test_decode_rejects_a_foreign_payload(name: str) -> None:
    codec = _codec(name)
    wrong = Payload(torch.zeros(3, dtype=torch.uint8), 1000)
    with pytest.raises(ConfigError):
        codec.decode(wrong)
