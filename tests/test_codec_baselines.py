"""Properties of the baseline codecs: cast precision, exact top-k, unbiased QSGD/TernGrad,
scaled sign, bit-packed sizes."""

from __future__ import annotations

import math

import pytest
import torch

from superneurons.codecs.coding.bitpack import packed_bytes
from superneurons.compress import (
    Bf16Codec,
    Fp16Codec,
    IdentityCodec,
    QSGDCodec,
    SignSGDCodec,
    TernGradCodec,
    TopKCodec,
)
from superneurons.errors import ConfigError

# Total probability that a correct unbiased codec fails an unbiasedness test (union bound).
_FALSE_ALARM = 1e-6


def _hoeffding_halfwidth(width: torch.Tensor, draws: int, count: int) -> torch.Tensor:
    """Half-width t with P(|mean - E| >= t) <= _FALSE_ALARM / count for one element whose
    ``draws`` i.i.d. samples lie in an interval of ``width`` (Hoeffding); union over ``count``."""
    return width * math.sqrt(math.log(2 * count / _FALSE_ALARM) / (2 * draws))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_identity_round_trips_exactly(dtype: torch.dtype) -> None:
    grad = torch.randn(1001).to(dtype)
    codec = IdentityCodec()
    assert torch.equal(codec.decode(codec.encode(grad)), grad.float())


def test_fp16_and_bf16_within_their_precision() -> None:
    grad = torch.randn(10_000) * 100  # normal range of fp16: |v| >= 2**-14
    grad = grad[grad.abs() > 2**-14]
    for codec, unit_roundoff in ((Fp16Codec(), 2.0**-11), (Bf16Codec(), 2.0**-8)):
        decoded = codec.decode(codec.encode(grad))
        assert bool(((decoded - grad).abs() <= unit_roundoff * grad.abs()).all()), codec.spec
        assert codec.payload_bytes(grad.numel()) == 2 * grad.numel()


def test_fp16_overflow_becomes_inf_bf16_does_not() -> None:
    grad = torch.tensor([1e5, -1e5, 1.0])
    assert Fp16Codec().decode(Fp16Codec().encode(grad))[:2].isinf().all()
    assert torch.isfinite(Bf16Codec().decode(Bf16Codec().encode(grad))).all()


@pytest.mark.parametrize("numel", [1, 10, 1000, 4097])
def test_topk_keeps_exactly_the_k_largest(numel: int) -> None:
    grad = torch.randn(numel)
    codec = TopKCodec(ratio=0.05)
    k = codec.kept(numel)
    assert k == max(1, round(0.05 * numel)) and codec.payload_bytes(numel) == 8 * k
    decoded = codec.decode(codec.encode(grad))
    kept = decoded != 0
    assert int(kept.sum()) == k
    assert torch.equal(decoded[kept], grad[kept])  # fp32 values travel unchanged
    smallest_kept = grad[kept].abs().min()
    assert bool((grad[~kept].abs() <= smallest_kept).all())


def test_topk_sampled_equals_exact_and_counts_exactly() -> None:
    grad = torch.randn(200_000)
    exact = TopKCodec(ratio=0.01)
    sampled = TopKCodec(ratio=0.01, select="sampled")
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        assert torch.equal(
            exact.decode(exact.encode(grad)), sampled.decode(sampled.encode(grad, generator=gen))
        )
    ties = torch.ones(50_000)  # every magnitude equal: the threshold keeps all; still exactly k
    decoded = sampled.decode(sampled.encode(ties))
    assert int((decoded != 0).sum()) == sampled.kept(50_000)


def test_topk_decode_sum_adds_overlapping_indices() -> None:
    codec = TopKCodec(ratio=0.1)
    a, b = torch.randn(100), torch.randn(100)
    b[:50] = a[:50] * 10  # overlapping supports
    total = codec.decode_sum([codec.encode(a), codec.encode(b)])
    torch.testing.assert_close(total, codec.decode(codec.encode(a)) + codec.decode(codec.encode(b)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ratio": 0.0}, "ratio"),
        ({"ratio": 1.5}, "ratio"),
        ({"ratio": math.nan}, "ratio"),
        ({"select": "random"}, "select"),
    ],
)
def test_topk_rejects_bad_config(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TopKCodec(**kwargs)  # type: ignore[arg-type]


def test_qsgd_bits_and_payload() -> None:
    assert QSGDCodec(levels=15).bits == 5  # 16 level codes 0..15 + sign
    assert QSGDCodec(levels=16).bits == 6
    assert QSGDCodec(levels=1).bits == 2
    codec = QSGDCodec(levels=16, bucket=100)
    assert codec.payload_bytes(1000) == 4 * 10 + packed_bytes(1000, 6)
    assert codec.payload_bytes(1001) == 4 * 11 + packed_bytes(1001, 6)


def test_qsgd_levels_are_multiples_of_norm_over_s() -> None:
    codec = QSGDCodec(levels=4, bucket=64)
    grad = torch.randn(64)
    decoded = codec.decode(codec.encode(grad, generator=torch.Generator().manual_seed(0)))
    units = decoded / grad.norm() * 4
    torch.testing.assert_close(units, units.round(), rtol=0, atol=1e-5)
    assert bool((units.abs() <= 4 + 1e-5).all())


def test_qsgd_is_unbiased() -> None:
    """Mean of N decodes -> input; bound from Hoeffding: each draw of element i lies in
    [floor, floor + 1] * norm_b / s, so the width is norm_b / s."""
    numel, bucket, levels, draws = 96, 32, 4, 3000
    codec = QSGDCodec(levels=levels, bucket=bucket)
    grad = torch.randn(numel)
    gen = torch.Generator().manual_seed(0)
    total = torch.zeros(numel, dtype=torch.float64)
    for _ in range(draws):
        total += codec.decode(codec.encode(grad, generator=gen)).double()
    mean = total / draws
    norms = grad.view(-1, bucket).norm(dim=1).repeat_interleave(bucket).double()
    halfwidth = _hoeffding_halfwidth(norms / levels, draws, numel)
    assert bool(((mean - grad.double()).abs() <= halfwidth + 1e-6 * norms).all())
    # and it is genuinely stochastic (not the deterministic nearest level)
    single = codec.decode(codec.encode(grad, generator=gen))
    assert not torch.allclose(single, mean.float(), atol=1e-3)


@pytest.mark.parametrize(
    "kwargs", [{"levels": 0}, {"levels": 40_000}, {"levels": 2.5}, {"bucket": 0}, {"levels": True}]
)
def test_qsgd_rejects_bad_config(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="qsgd"):
        QSGDCodec(**kwargs)  # type: ignore[arg-type]


def test_terngrad_is_unbiased_for_the_clipped_gradient() -> None:
    """Each draw of element i is 0 or scale * sign(g_i): interval width = scale (Hoeffding)."""
    numel, draws = 128, 3000
    codec = TernGradCodec(clip=2.5)
    grad = torch.randn(numel)
    grad[7] = 40.0  # an outlier that clipping must cut to 2.5 sigma
    clipped = codec.clipped(grad).double()
    rms = grad.norm() / math.sqrt(numel)
    assert float(clipped[7]) == pytest.approx(2.5 * float(rms), rel=1e-6)
    scale = clipped.abs().max()
    gen = torch.Generator().manual_seed(0)
    total = torch.zeros(numel, dtype=torch.float64)
    for _ in range(draws):
        decoded = codec.decode(codec.encode(grad, generator=gen))
        total += decoded.double()
    magnitude = decoded.abs().double()
    assert bool(((magnitude == 0) | torch.isclose(magnitude, scale, rtol=1e-6)).all())
    halfwidth = _hoeffding_halfwidth(scale.expand(numel), draws, numel)
    assert bool(((total / draws - clipped).abs() <= halfwidth + 1e-6 * scale).all())


def test_terngrad_payload_is_two_bits_per_element() -> None:
    codec = TernGradCodec()
    for numel in (1, 4, 5, 1000):
        assert codec.payload_bytes(numel) == 4 + math.ceil(numel * 2 / 8)
    assert (
        TernGradCodec(clip=math.inf)
        .decode(TernGradCodec(clip=math.inf).encode(torch.ones(3)))
        .eq(1)
        .all()
    )
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ConfigError, match="clip"):
            TernGradCodec(clip=bad)


def test_signsgd_scaled_sign() -> None:
    codec = SignSGDCodec()
    grad = torch.randn(1001)
    decoded = codec.decode(codec.encode(grad))
    scale = grad.abs().mean()
    torch.testing.assert_close(decoded.abs(), scale.expand(1001))
    assert torch.equal(torch.sign(decoded), torch.where(grad < 0, -1.0, 1.0))
    assert codec.payload_bytes(1001) == 4 + 126  # one bit per element, bit-packed


@pytest.mark.parametrize("levels", [1, 3, 16, 100, 1000])
def test_qsgd_codes_use_the_bitpack_layout(levels: int) -> None:
    """QSGD's fast packer for odd widths must produce bitpack's exact bytes."""
    from superneurons.codecs.coding.bitpack import unpack_bits

    codec = QSGDCodec(levels=levels, bucket=1000)
    numel = 1001
    payload = codec.encode(torch.randn(numel), generator=torch.Generator().manual_seed(0))
    codes = unpack_bits(payload.data[8:], codec.bits, numel)  # 2 norms = 8 header bytes
    sign_bit = 1 << (codec.bits - 1)
    levels_sent = (codes & (sign_bit - 1)).float()
    signs = torch.where(codes >= sign_bit, -1.0, 1.0)
    norms = payload.data[:8].view(torch.float32).repeat_interleave(1000)[:numel]
    torch.testing.assert_close(codec.decode(payload), signs * levels_sent / levels * norms)


def test_topk_sampled_falls_back_to_exact_when_the_threshold_is_too_high(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from superneurons.codecs.sparse import topk as topk_module

    monkeypatch.setattr(topk_module, "_OVERSAMPLE", 0.1)  # threshold leaves ~k/10 survivors
    grad = torch.randn(100_000)
    exact, sampled = TopKCodec(ratio=0.01), TopKCodec(ratio=0.01, select="sampled")
    assert torch.equal(exact.decode(exact.encode(grad)), sampled.decode(sampled.encode(grad)))
