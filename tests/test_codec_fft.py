"""FFT codec (HPDC'20): Parseval bound, fixed-size payloads, linearity, index codes, policies."""

from __future__ import annotations

import math
import re

import pytest
import torch

from superneurons.codecs.codec import Codec, sum_of_decodes
from superneurons.codecs.coding.indexcode import (
    bitmap_bytes,
    decode_bitmap,
    decode_gap,
    encode_bitmap,
    encode_gap,
    gap_bytes,
)
from superneurons.codecs.sparse.fft import FFTCodec, kept_count, select_bins, spectrum_layout
from superneurons.errors import ConfigError

SIZES = (1, 2, 3, 7, 97, 1000, 4097, 2**20)


def _gradients(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random and real-like gradients: white, heavy-tailed, smooth, sparse, periodic."""
    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=gen)
    sparse = torch.zeros(n)
    spikes = max(1, n // 100)
    sparse[torch.randint(n, (spikes,), generator=gen)] = torch.randn(spikes, generator=gen) * 10
    t = torch.arange(n, dtype=torch.float32)
    return {
        "normal": normal,
        "heavy": normal**3,
        "smooth": torch.cumsum(normal, 0) / math.sqrt(n),
        "sparse": sparse,
        "periodic": torch.sin(t * 0.37) + 0.1 * normal,
    }


def _rel_err_sq(restored: torch.Tensor, original: torch.Tensor) -> float:
    ref = original.double()
    return float((restored.double() - ref).square().sum() / ref.square().sum().clamp_min(1e-300))


@pytest.mark.parametrize("theta", [0.1, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("n,chunk", [(97, 0), (1000, 0), (4097, 0), (4099, 256), (3001, 1024)])
def test_parseval_bound_sparsification_alone(theta: float, n: int, chunk: int) -> None:
    # bits=32 keeps the kept values exact, so only the dropping is measured.
    codec = FFTCodec(theta=theta, bits=32, chunk=chunk)
    for name, grad in _gradients(n).items():
        err_sq = _rel_err_sq(codec.decode(codec.encode(grad)), grad)
        assert err_sq <= theta + 1e-5, (name, err_sq)


def test_parseval_bound_with_sampled_selection_on_a_large_bucket() -> None:
    n = 2**17 + 4099  # 33 chunks (> 4 * sample size bins), a short zero-padded tail
    for theta in (0.5, 0.9):
        exact = FFTCodec(theta=theta, bits=32, chunk=4096, select="exact")
        sampled = FFTCodec(theta=theta, bits=32, chunk=4096, select="sampled")
        for name, grad in _gradients(n, seed=3).items():
            if name == "sparse":
                continue  # many exactly-equal powers: ties make the two kept sets differ legally
            from_exact = exact.decode(exact.encode(grad))
            from_sampled = sampled.decode(sampled.encode(grad))
            assert _rel_err_sq(from_sampled, grad) <= theta + 1e-5, name
            torch.testing.assert_close(from_sampled, from_exact, rtol=0, atol=0)


def test_select_bins_keeps_exactly_the_largest() -> None:
    gen = torch.Generator().manual_seed(5)
    score = torch.rand(300_000, generator=gen)
    for count in (1, 1000, 30_000, 299_999):
        for select in ("exact", "sampled"):
            mask, indices = select_bins(score, count, select)
            assert int(mask.sum()) == count == indices.numel()
            assert bool((indices[1:] > indices[:-1]).all())
            assert float(score[mask].min()) >= float(score[~mask].max())


def test_theta_zero_round_trips_to_float32_fft_tolerance() -> None:
    # Lossless values + nothing dropped: irfft(rfft(g)) == g up to float32 FFT round-off
    # (not bitwise: the transform rounds).
    for chunk in (0, 512):
        codec = FFTCodec(theta=0.0, bits=32, chunk=chunk)
        for grad in _gradients(2053).values():
            restored = codec.decode(codec.encode(grad))
            scale = float(grad.abs().max())
            torch.testing.assert_close(restored, grad, rtol=1e-5, atol=1e-5 * scale)


CONFIGS = (
    FFTCodec(),
    FFTCodec(chunk=0, select="exact"),
    FFTCodec(chunk=4096, select="sampled", index="gap"),
    FFTCodec(theta=0.5, bits=4, chunk=1024),
    FFTCodec(theta=0.0, bits=32),
    FFTCodec(theta=0.99, bits=16, index="gap"),
)


@pytest.mark.parametrize("codec", CONFIGS, ids=lambda c: c.spec)
def test_payload_bytes_equal_encoded_bytes_and_do_not_depend_on_data(codec: FFTCodec) -> None:
    for n in SIZES:
        grads = _gradients(n).values() if n < 2**16 else [torch.randn(n)]
        sizes = {codec.encode(g).nbytes for g in grads}
        assert sizes == {codec.payload_bytes(n)}, n


def test_kept_count_is_a_fixed_function_and_bits_per_element_target() -> None:
    for universe in (1, 2, 10, 101, 524_289):
        for theta in (0.0, 0.3, 0.9, 0.999):
            kept = kept_count(universe, theta)
            assert 1 <= kept <= universe
            assert (universe - kept) / universe <= theta + 1e-12
    assert spectrum_layout(4097, 4096) == (4096, 2)
    assert spectrum_layout(100, 4096) == (100, 1)
    n = 2**20
    for chunk in (0, 512, 4096):
        bitmap = FFTCodec(theta=0.9, bits=8, chunk=chunk, index="bitmap").payload_bytes(n)
        assert 8 * bitmap / n <= 1.5  # task target; the bitmap layout predicts ~1.30
        gap = FFTCodec(theta=0.9, bits=8, chunk=chunk, index="gap").payload_bytes(n)
        assert gap < bitmap  # Elias-Fano wins at theta = 0.9
        auto = FFTCodec(theta=0.9, bits=8, chunk=chunk)  # default index="auto": the smaller
        assert auto.payload_bytes(n) == min(gap, bitmap) and auto.index_kind(n) == "gap"
    low = FFTCodec(theta=0.3, bits=8)  # dense spectra: the bitmap is smaller
    assert low.index_kind(n) == "bitmap"
    assert low.payload_bytes(n) == FFTCodec(theta=0.3, bits=8, index="bitmap").payload_bytes(n)


@pytest.mark.parametrize("codec", CONFIGS, ids=lambda c: c.spec)
def test_decode_sum_equals_sum_of_decodes(codec: FFTCodec) -> None:
    n = 5003
    payloads = [codec.encode(g) for g in _gradients(n, seed=7).values()]
    scale = float(sum_of_decodes(codec, payloads).abs().max())
    torch.testing.assert_close(
        codec.decode_sum(payloads), sum_of_decodes(codec, payloads), rtol=1e-5, atol=1e-5 * scale
    )


def test_quantized_error_stays_near_the_sparsification_error() -> None:
    grad = _gradients(65_536)["smooth"]
    for theta in (0.5, 0.9):
        lossless = FFTCodec(theta=theta, bits=32, chunk=4096)
        quantized = FFTCodec(theta=theta, bits=8, chunk=4096)
        sparse_only = lossless.decode(lossless.encode(grad))
        both = quantized.decode(quantized.encode(grad))
        # Quantization error is relative to the kept coefficients (<= 2**-(m+1), m >= 2 at 8 bits).
        extra = float((both - sparse_only).norm() / sparse_only.norm())
        assert extra <= 0.125


def test_index_codes_round_trip() -> None:
    patterns = torch.arange(256)
    bits = ((patterns.unsqueeze(1) >> torch.arange(8)) & 1).bool().reshape(-1)  # all bytes
    packed = encode_bitmap(bits)
    assert torch.equal(packed.long(), patterns)  # LSB-first, exhaustively checked
    assert torch.equal(decode_bitmap(packed, bits.numel()), bits)
    gen = torch.Generator().manual_seed(2)
    for universe, count in ((1, 1), (5, 1), (10, 3), (1000, 1000), (9_999, 100), (524_289, 52_429)):
        indices = torch.randperm(universe, generator=gen)[:count].sort().values
        mask = torch.zeros(universe, dtype=torch.bool)
        mask[indices] = True
        assert encode_bitmap(mask).numel() == bitmap_bytes(universe)
        assert torch.equal(decode_bitmap(encode_bitmap(mask), universe), mask)
        gap = encode_gap(indices, universe)
        assert gap.numel() == gap_bytes(universe, count)
        assert torch.equal(decode_gap(gap, universe, count), indices)


def test_spec_format_and_protocol() -> None:
    codec = FFTCodec()
    assert isinstance(codec, Codec)
    assert codec.summable is False
    assert FFTCodec.NAME == "fft"
    pattern = (
        r"fft:theta=[0-9.e-]+,bits=\d+,chunk=\d+,select=(exact|sampled),index=(bitmap|gap|auto)"
    )
    for c in CONFIGS:
        assert re.fullmatch(pattern, c.spec), c.spec
        fields = dict(item.split("=") for item in c.spec.split(":", 1)[1].split(","))
        rebuilt = FFTCodec(
            theta=float(fields["theta"]),
            bits=int(fields["bits"]),
            chunk=int(fields["chunk"]),
            select=fields["select"],
            index=fields["index"],
        )
        assert rebuilt == c
    assert FFTCodec(theta=0.9, bits=8, chunk=0, select="exact", index="bitmap").spec == (
        "fft:theta=0.9,bits=8,chunk=0,select=exact,index=bitmap"
    )
    assert FFTCodec().spec == "fft:theta=0.9,bits=8,chunk=512,select=sampled,index=auto"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"theta": 1.0}, r"\[0, 1\)"),
        ({"theta": -0.1}, r"\[0, 1\)"),
        ({"theta": "0.9"}, "number"),
        ({"bits": 7}, r"\[4, 8, 16, 32\]"),
        ({"chunk": -1}, ">= 0"),
        ({"select": "random"}, "exact"),
        ({"index": "rle"}, "bitmap"),
    ],
)
def test_bad_hyper_parameters_raise_helpful_config_errors(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        FFTCodec(**kwargs)  # type: ignore[arg-type]


def test_bad_inputs_raise_config_error() -> None:
    codec = FFTCodec()
    with pytest.raises(ConfigError, match="floating point"):
        codec.encode(torch.arange(10, dtype=torch.int32))
    with pytest.raises(ConfigError, match="empty"):
        codec.encode(torch.zeros(0))
    with pytest.raises(ConfigError, match="was it made by"):
        codec.decode(FFTCodec(theta=0.5).encode(torch.randn(100)))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("codec", CONFIGS, ids=lambda c: c.spec)
def test_non_finite_input_decodes_to_all_nan(bad: float, codec: FFTCodec) -> None:
    grad = torch.randn(5000)
    grad[1234] = bad
    payload = codec.encode(grad)  # never raises
    assert payload.nbytes == codec.payload_bytes(5000)
    assert bool(torch.isnan(codec.decode(payload)).all())
    good = codec.encode(torch.randn(5000))
    assert bool(torch.isnan(codec.decode_sum([good, payload])).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype: torch.dtype) -> None:
    grad = torch.randn(4096).to(dtype)
    for codec in (FFTCodec(), FFTCodec(chunk=1024, bits=32)):
        decoded = codec.decode(codec.encode(grad))
        assert decoded.dtype == torch.float32
        reference = codec.decode(codec.encode(grad.float()))
        torch.testing.assert_close(decoded, reference, rtol=0, atol=0)


def test_encode_and_decode_leave_their_inputs_untouched() -> None:
    grad = _gradients(3000)["heavy"]
    before = grad.clone()
    for codec in CONFIGS:
        payload = codec.encode(grad)
        data = payload.data.clone()
        codec.decode_sum([payload, payload])
        assert torch.equal(grad, before), codec.spec
        assert torch.equal(payload.data, data), codec.spec
