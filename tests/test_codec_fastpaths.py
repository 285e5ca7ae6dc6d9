"""The CPU fast paths of the baseline codecs: counter-based noise, SWAR / multiply-gather bit
packing, byte-table decodes, bracketed exact top-k. Each must equal its plain definition."""

from __future__ import annotations

import itertools

import pytest
import torch

from superneurons.codecs.coding import noise
from superneurons.codecs.coding.bitpack import byte_codes, pack_bits, unpack_bits
from superneurons.codecs.coding.indexcode import decode_gap, encode_gap, gap_low_bits
from superneurons.codecs.coding.rangefloat import (
    dequantize,
    quantize,
    read_codes,
    read_values,
    write_codes,
)
from superneurons.compress import Payload, QSGDCodec, SignSGDCodec, TernGradCodec, TopKCodec


def _reference_pack(codes: list[int], bits: int) -> torch.Tensor:
    """The wire layout by definition: codes laid out consecutively, LSB-first in each byte."""
    stream = [(code >> i) & 1 for code in codes for i in range(bits)]
    stream += [0] * (-len(stream) % 8)
    return torch.tensor(
        [
            sum(bit << i for i, bit in enumerate(stream[j : j + 8]))
            for j in range(0, len(stream), 8)
        ],
        dtype=torch.uint8,
    )


@pytest.mark.parametrize(("bits", "group"), [(1, 8), (2, 4), (6, 4)])
def test_fast_packing_equals_the_definition(bits: int, group: int) -> None:
    if bits == 6:  # every code in every slot of a word, plus random words
        values = [[v] * group for v in range(64)] + torch.randint(0, 64, (500, group)).tolist()
    else:  # exhaustive over one word's worth of codes
        values = [list(c) for c in itertools.product(range(2**bits), repeat=group)]
    codes = [code for word in values for code in word]
    packed = pack_bits(torch.tensor(codes), bits)
    assert torch.equal(packed, _reference_pack(codes, bits))
    assert torch.equal(unpack_bits(packed, bits, len(codes)), torch.tensor(codes))


def test_noise_is_seeded_fresh_per_call_and_blocking_free(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    a = noise.uniform_bits(100_000, generator=torch.Generator().manual_seed(3), device=cpu)
    gen = torch.Generator().manual_seed(3)
    monkeypatch.setattr(noise, "_CPU_BLOCK", 777)  # block boundaries must not change values
    b = noise.uniform_bits(100_000, generator=gen, device=cpu)
    c = noise.uniform_bits(100_000, generator=gen, device=cpu)
    assert torch.equal(a, b) and not torch.equal(b, c)
    u = noise.uniform_one_two(100_000, generator=gen, device=cpu)
    assert u.dtype == torch.float32 and bool(((u >= 1) & (u < 2)).all())
    # 16 equal bins of the top 4 bits: counts within 6 binomial sigmas of 100_000 / 16
    counts = torch.bincount(((a >> 28) & 15).long(), minlength=16).double()
    sigma = (100_000 * (1 / 16) * (15 / 16)) ** 0.5
    assert bool(((counts - 100_000 / 16).abs() < 6 * sigma).all())


def test_noise_at_one_position_is_uniform_over_keys() -> None:
    """Unbiasedness rests on each position's word being uniform over keys (module doc)."""
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack(
        [noise.uniform_one_two(3, generator=gen, device=torch.device("cpu")) for _ in range(600)]
    )  # (600, 3)
    mean = (draws - 1).mean(dim=0).double()
    assert bool(((mean - 0.5).abs() < 6 * (1 / 12 / 600) ** 0.5).all())


@pytest.mark.parametrize(
    "codec", [QSGDCodec(), QSGDCodec(levels=15, bucket=100), TernGradCodec(), SignSGDCodec()]
)
def test_same_generator_seed_same_payload(codec: object) -> None:
    grad = torch.randn(4099, generator=torch.Generator().manual_seed(1))
    first = codec.encode(grad, generator=torch.Generator().manual_seed(5))  # type: ignore[attr-defined]
    again = codec.encode(grad, generator=torch.Generator().manual_seed(5))  # type: ignore[attr-defined]
    assert torch.equal(first.data, again.data)


def test_qsgd_decode_keeps_sign_and_level_for_every_code() -> None:
    """Every 6-bit code (level in the low 5 bits, sign on top) decodes to sign * level * n / s."""
    codec = QSGDCodec(levels=16, bucket=64)
    codes = torch.arange(64)
    data = torch.cat([torch.tensor([16.0]).view(torch.uint8), pack_bits(codes, 6)])
    decoded = codec.decode(Payload(data, 64))  # norm 16, s = 16: one unit per level
    expected = (codes & 31).float() * (1 - 2 * (codes >> 5)).float()
    assert torch.equal(decoded, expected)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_byte_table_unpacks_every_byte_as_unpack_bits_does(bits: int) -> None:
    every_byte = torch.arange(256, dtype=torch.uint8)
    expected = unpack_bits(every_byte, bits, 256 * (8 // bits)).view(256, -1)
    assert torch.equal(byte_codes(bits, every_byte.device), expected.to(torch.int32))


def test_terngrad_and_sign_table_decodes_match_the_definition() -> None:
    grad = torch.randn(1001, generator=torch.Generator().manual_seed(2))
    payload = TernGradCodec().encode(grad, generator=torch.Generator().manual_seed(0))
    scale = payload.data[:4].view(torch.float32)
    codes = unpack_bits(payload.data[4:], 2, 1001)
    expected = ((codes == 1).float() - (codes == 2).float()) * scale
    assert torch.equal(TernGradCodec().decode(payload), expected)
    sign = SignSGDCodec().encode(grad)
    negative = unpack_bits(sign.data[4:], 1, 1001).float()
    assert torch.equal(SignSGDCodec().decode(sign), (1 - 2 * negative) * grad.abs().mean())


def test_topk_exact_on_cpu_keeps_torch_topk_set() -> None:
    grad = torch.randn(300_000, generator=torch.Generator().manual_seed(4))
    codec = TopKCodec(ratio=0.01)
    decoded = codec.decode(codec.encode(grad))
    expected = torch.zeros_like(grad)
    top = torch.topk(grad.abs(), codec.kept(grad.numel())).indices
    expected[top] = grad[top]
    assert torch.equal(decoded, expected)


def test_rangefloat_byte_codes_skip_the_mask_but_keep_the_bytes() -> None:
    codes = torch.randint(-(2**31), 2**31 - 1, (1001,), dtype=torch.int32)
    packed = write_codes(codes, 8)
    assert torch.equal(packed, pack_bits((codes & 0xFF).long(), 8))
    assert torch.equal(read_codes(packed, 8, 1001), (codes & 0xFF))


# (universe, count) pairs whose Elias-Fano low parts take each fast width: 0, 1, 2, 4, 8, 16
_GAP_CASES = [
    (1000, 1000), (1000, 450), (10_000, 2_000), (100_000, 6_000), (1 << 20, 3_000), (1 << 24, 200)
]  # fmt: skip


@pytest.mark.parametrize(("universe", "count"), _GAP_CASES)
def test_gap_decode_on_the_cpu_equals_the_sync_free_path(universe: int, count: int) -> None:
    """The numpy decode of the CPU and the scatter of other devices, at every low-bit width."""
    gen = torch.Generator().manual_seed(count)
    indices = torch.randperm(universe, generator=gen)[:count].sort().values
    code = encode_gap(indices, universe)
    cpu = decode_gap(code, universe, count, sync_free=False)
    assert torch.equal(cpu, indices)
    assert torch.equal(decode_gap(code, universe, count, sync_free=True), indices)
    assert cpu.dtype == torch.int64


@pytest.mark.parametrize(("universe", "count"), [*_GAP_CASES, (1001, 1), (12_345, 4_321)])
def test_gap_encode_on_the_cpu_equals_the_torch_path(universe: int, count: int) -> None:
    """The numpy encode of the CPU writes the bytes of the torch ops other devices run."""
    from superneurons.codecs.coding.indexcode import (
        _encode_gap_numpy,
        _encode_gap_torch,
        gap_bytes,
    )

    gen = torch.Generator().manual_seed(universe + count)
    indices = torch.randperm(universe, generator=gen)[:count].sort().values
    low = gap_low_bits(universe, count)
    cpu = _encode_gap_numpy(indices, universe, count, low)
    assert torch.equal(cpu, _encode_gap_torch(indices, universe, count, low))
    assert cpu.dtype == torch.uint8 and cpu.numel() == gap_bytes(universe, count)
    assert torch.equal(encode_gap(indices, universe), cpu)


def test_gap_low_widths_are_all_covered() -> None:
    assert {gap_low_bits(u, c) for u, c in _GAP_CASES} == {0, 1, 2, 4, 8, 16}


@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("finite", [True, False])
def test_table_decode_of_range_floats_equals_the_element_wise_one(bits: int, finite: bool) -> None:
    """``read_values`` (a table of every code on the CPU) gives the bits of ``dequantize``,
    for an odd count (half a byte at 4 bits), values below the window and a NaN header."""
    gen = torch.Generator().manual_seed(bits)
    values = torch.randn(1001, generator=gen) * torch.logspace(-12, 0, 1001)
    if not finite:
        values[7] = float("nan")
    codes, header = quantize(values, bits, threshold=1e-6)
    data = write_codes(codes, bits)
    want = dequantize(read_codes(data, bits, values.numel()), header, bits)
    got = read_values(data, header, bits, values.numel())
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
