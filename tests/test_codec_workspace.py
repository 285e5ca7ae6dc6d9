"""Kept CPU work buffers (codecs/coding/workspace.py) and the numpy CPU scans: reuse, bounds, no leak
into results, results equal to the torch definitions."""

from __future__ import annotations

import threading

import pytest
import torch

from superneurons.codecs.coding import workspace as ws
from superneurons.schemes.grammar import parse_codec

CPU = torch.device("cpu")


def test_kept_per_tag_and_shape_and_fresh_elsewhere() -> None:
    first = ws.workspace("test.a", (5, 3), torch.float32, CPU)
    assert ws.workspace("test.a", (5, 3), torch.float32, CPU).data_ptr() == first.data_ptr()
    assert ws.workspace("test.b", (5, 3), torch.float32, CPU).data_ptr() != first.data_ptr()
    other = ws.workspace("test.a", (15,), torch.float32, CPU)
    assert other.data_ptr() != first.data_ptr() and other.shape == (15,)
    meta = ws.workspace("test.a", (5, 3), torch.float32, torch.device("meta"))
    assert meta.device.type == "meta"
    ws.clear_workspace()
    assert not ws._kept()


def test_bounded_shapes_per_tag_and_size_cap() -> None:
    for size in range(1, ws._SHAPES_PER_TAG + 3):
        ws.workspace("test.lru", (size,), torch.int32, CPU)
    assert len(ws._kept()["test.lru"]) == ws._SHAPES_PER_TAG
    big = ws._KEEP_MAX_BYTES // 4 + 1
    one = ws.workspace("test.big", (big,), torch.float32, CPU)
    two = ws.workspace("test.big", (big,), torch.float32, CPU)
    assert one.data_ptr() != two.data_ptr()  # above the cap: fresh every time
    del one, two


def test_threads_get_their_own_buffers() -> None:
    mine = ws.workspace("test.thread", (64,), torch.float32, CPU).data_ptr()
    theirs: list[int] = []
    thread = threading.Thread(
        target=lambda: theirs.append(
            ws.workspace("test.thread", (64,), torch.float32, CPU).data_ptr()
        )
    )
    thread.start()
    thread.join()
    assert theirs and theirs[0] != mine


@pytest.mark.parametrize(
    "spec", ["fft", "fft:index=bitmap", "ctopk", "adaptive", "adaptive:index=bitmap"]
)
def test_results_never_alias_kept_buffers(spec: str) -> None:
    # A later call reuses the kept buffers: earlier payloads and decodes must not change.
    codec = parse_codec(spec)
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(300_000, generator=gen) for _ in range(2)]
    first = codec.encode(grads[0])
    first_bytes = first.data.clone()
    decoded = codec.decode(first)
    decoded_bits = decoded.clone()
    second = codec.encode(grads[1])
    codec.decode(second)
    assert torch.equal(first.data, first_bytes)
    assert torch.equal(decoded.view(torch.int32), decoded_bits.view(torch.int32))
    assert torch.equal(codec.encode(grads[0]).data, first_bytes)  # deterministic through reuse


@pytest.mark.parametrize("density", [0.0, 0.003, 0.11, 0.5, 1.0])
def test_flat_nonzero_equals_torch_nonzero(density: float) -> None:
    from superneurons.codecs.coding.indexcode import flat_nonzero

    gen = torch.Generator().manual_seed(7)
    mask = torch.rand(100_003, generator=gen) < density
    got = flat_nonzero(mask)
    assert got.dtype == torch.int64 and got.device == mask.device
    assert torch.equal(got, mask.nonzero().reshape(-1))
    strided = mask[::3]  # a view: taken contiguous first
    assert torch.equal(flat_nonzero(strided), strided.nonzero().reshape(-1))


def test_sampled_selection_equals_exact_on_the_numpy_path() -> None:
    from superneurons.codecs.coding.sparsecode import select_indices

    gen = torch.Generator().manual_seed(11)
    score = torch.randn(600_000, generator=gen).square()
    for count in (600, 60_000, 300_000):
        sampled = select_indices(score, count, "sampled", period=257)
        exact = select_indices(score, count, "exact")
        assert torch.equal(sampled, exact)


def test_kth_smallest_equals_kthvalue_with_ties_and_nan() -> None:
    from superneurons.codecs.coding.sparsecode import kth_smallest

    gen = torch.Generator().manual_seed(5)
    # many ties; + 0.0 turns -0 into +0: the codecs rank squares, never -0, and kthvalue and
    # numpy may return either zero of a +-0 tie
    values = torch.randn(5000, generator=gen).round_() + 0.0
    values[::97] = float("nan")
    for rank in (1, 7, 2500, 4000, 4940, 4999, 5000):
        want = torch.kthvalue(values, rank).values
        (got,) = kth_smallest(values, rank)
        assert torch.equal(got.reshape(1).view(torch.int32), want.reshape(1).view(torch.int32))
        assert got.shape == () and got.dtype == values.dtype
    for ranks in ((10, 4000), (4999, 7, 2500, 7), (5000, 4940)):  # any order, repeats, NaN
        got_all = kth_smallest(values, *ranks)
        want_all = [torch.kthvalue(values, r).values for r in ranks]
        for got, want in zip(got_all, want_all, strict=True):
            assert got.reshape(1).view(torch.int32) == want.reshape(1).view(torch.int32)


def test_set_positions_equals_index_fill() -> None:
    from superneurons.codecs.coding.indexcode import set_positions

    gen = torch.Generator().manual_seed(9)
    indices = torch.randint(0, 10_000, (3000,), generator=gen)
    want = torch.zeros(10_000, dtype=torch.bool).index_fill_(0, indices, True)
    assert torch.equal(set_positions(torch.zeros(10_000, dtype=torch.bool), indices), want)


def test_transforms_into_a_given_spectrum_equal_the_fresh_ones() -> None:
    from superneurons.codecs.adaptive.bases import dct, fourier

    chunks = torch.randn(33, 64, generator=torch.Generator().manual_seed(2))
    for transform in (fourier, dct):
        spectrum = torch.full((33, 66), float("nan"))
        got = transform(chunks, spectrum=spectrum)
        assert got.data_ptr() == spectrum.data_ptr()
        assert torch.equal(got.contiguous().view(torch.int32), transform(chunks).view(torch.int32))


def test_range_exponent_bits_equal_the_loop_definition() -> None:
    from superneurons.codecs.coding.rangefloat import _max_exp_bits, _range_exp_bits

    for bits in (4, 8, 16):
        for top in (-127, 0, 127):  # every binade count from -253 to 255 with the floors
            for floor in range(-127, 128):
                threshold = torch.tensor(2.0**floor if floor > -127 else 0.0)
                binades = top - max(floor, -127) + 1
                want = 1 + sum(binades > 2**e - 1 for e in range(1, _max_exp_bits(bits)))
                got = _range_exp_bits(torch.tensor(top, dtype=torch.int32), threshold, bits)
                assert int(got) == want and got.dtype == torch.int32, (bits, top, floor)


@pytest.mark.parametrize("universe", [1, 7, 8, 9, 4097])
def test_bitmap_positions_equal_the_decoded_mask(universe: int) -> None:
    from superneurons.codecs.coding.indexcode import bitmap_positions, decode_bitmap, encode_bitmap

    mask = torch.rand(universe, generator=torch.Generator().manual_seed(universe)) < 0.3
    data = encode_bitmap(mask)
    want = decode_bitmap(data, universe).nonzero().reshape(-1)
    assert torch.equal(want, mask.nonzero().reshape(-1))
    assert torch.equal(bitmap_positions(data, universe), want)
    assert torch.equal(bitmap_positions(data[1:].clone()[:0], 0), want[:0])


@pytest.mark.parametrize("universe", [1, 8, 13, 4099])
def test_numpy_bitmap_packing_equals_the_device_gather(universe: int) -> None:
    from superneurons.codecs.coding.indexcode import encode_bitmap

    mask = torch.rand(universe, generator=torch.Generator().manual_seed(universe)) < 0.4
    # a uint8 0/1 mask takes the multiply-gather every other device runs
    assert torch.equal(encode_bitmap(mask), encode_bitmap(mask.to(torch.uint8)))
