"""The fused quantisation kernels (codecs/coding/native.py, rowquant.c) write the bits of the
torch sequence they replace, on values chosen to break them (signed zeros, subnormals, a scale
whose double overflows, all-zero rows), and build or step aside cleanly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from superneurons.codecs.coding import native
from superneurons.codecs.coding.bitpack import pack_rows_
from superneurons.codecs.coding.chunkquant import dequantize_rows, quantize_rows

COLS = 64


@pytest.fixture(scope="module")
def library():  # type: ignore[no-untyped-def]
    built = native.kernels()
    if built is None:
        pytest.skip("no C compiler here: the kernels cannot be built")
    return built


def _hard_rows() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, COLS, generator=gen)
    x[1] = 0.0
    x[2] = -0.0
    x[3, ::2] = -0.0  # mixed signed zeros
    x[4] = torch.randn(COLS, generator=gen) * 1e-41  # subnormals
    x[5] = torch.randn(COLS, generator=gen).sign() * 3e38  # 2 * scale overflows to inf
    x[6] = torch.linspace(-1.0, 1.0, COLS)  # values on the grid's midpoints at some widths
    x[7] = 1.0  # one sign, one magnitude
    x[8, 0] = 1e30  # one outlier
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_quantise_and_dequantise_equal_the_torch_sequence(library, bits: int) -> None:  # type: ignore[no-untyped-def]
    x = _hard_rows()
    rows = x.shape[0]
    codes, scales = quantize_rows(x, bits=bits, rounding="nearest")
    want_decoded = dequantize_rows(codes, scales, bits=bits)
    want_error = x - want_decoded
    want_packed = torch.empty(1, rows * COLS * bits // 8, dtype=torch.uint8)
    pack_rows_(codes.clone().view(1, -1), bits, out=want_packed)

    levels = (1 << bits) - 1
    step = scales * (2.0 / levels)
    if bits == 1:
        factor, offset = None, 0.0
    else:
        factor = torch.where(scales > 0, scales.reciprocal() * (levels / 2.0), 0.0)
        offset = levels / 2.0 + 0.5
    packed = torch.full((rows * COLS * bits // 8,), 7, dtype=torch.uint8)
    decoded, error = torch.full_like(x, 7.0), torch.full_like(x, 7.0)
    native.quantize_rows_into(
        library, x, bits=bits, packed=packed, scale=scales, step=step, factor=factor,
        offset=offset, decoded=decoded, error=error,
    )  # fmt: skip
    assert torch.equal(packed, want_packed.view(-1))
    assert torch.equal(_bits(decoded), _bits(want_decoded))
    assert torch.equal(_bits(error), _bits(want_error))

    back = torch.full_like(x, 7.0)
    native.dequantize_rows_into(library, packed, bits=bits, step=step, scale=scales, out=back)
    assert torch.equal(_bits(back), _bits(want_decoded))


def test_codes_alone_need_no_step(library) -> None:  # type: ignore[no-untyped-def]
    x = _hard_rows()
    codes, scales = quantize_rows(x, bits=1, rounding="nearest")
    want = torch.empty(1, x.numel() // 8, dtype=torch.uint8)
    pack_rows_(codes.clone().view(1, -1), 1, out=want)
    packed = torch.empty(x.numel() // 8, dtype=torch.uint8)
    native.quantize_rows_into(library, x, bits=1, packed=packed, scale=scales, step=None)
    assert torch.equal(packed, want.view(-1))


def test_signs_and_magnitudes_in_one_pass(library) -> None:  # type: ignore[no-untyped-def]
    x = _hard_rows()
    x[9, :3] = float("nan")
    codes, _ = quantize_rows(x, bits=1, rounding="nearest")
    want = torch.empty(1, x.numel() // 8, dtype=torch.uint8)
    pack_rows_(codes.clone().view(1, -1), 1, out=want)
    packed = torch.empty(x.numel() // 8, dtype=torch.uint8)
    magnitude = torch.full_like(x, 7.0)
    native.sign_rows_into(library, x, packed=packed, magnitude=magnitude)
    assert torch.equal(packed, want.view(-1))
    assert torch.equal(_bits(magnitude), _bits(torch.abs(x)))


def test_wrong_buffers_are_refused_before_the_kernel_runs(library) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(4, COLS)
    scales = torch.ones(4)
    with pytest.raises(ValueError, match="uint8"):
        native.quantize_rows_into(
            library, x, bits=4, packed=torch.empty(128), scale=scales, step=scales
        )
    with pytest.raises(ValueError, match="elements"):
        native.quantize_rows_into(
            library, x, bits=4, packed=torch.empty(64, dtype=torch.uint8), scale=scales,
            step=scales, factor=scales,
        )  # fmt: skip
    with pytest.raises(ValueError, match="contiguous"):
        native.dequantize_rows_into(
            library, torch.empty(128, dtype=torch.uint8), bits=4, step=scales, scale=scales,
            out=torch.empty(COLS, 4).t(),
        )  # fmt: skip


@pytest.fixture
def fresh_kernels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    """native.kernels() decided again under this test's environment, then as it was."""
    monkeypatch.setenv("SUPERNEURONS_CACHE_DIR", str(tmp_path / "cache"))
    native.kernels.cache_clear()
    native.spectrum_kernels.cache_clear()
    yield tmp_path / "cache"
    native.kernels.cache_clear()
    native.spectrum_kernels.cache_clear()


def test_a_build_lands_whole_in_the_cache_and_is_reused(fresh_kernels, library) -> None:  # type: ignore[no-untyped-def]
    assert native.kernels() is not None
    built = sorted(p.name for p in fresh_kernels.iterdir())
    assert len(built) == 1 and built[0].startswith("rowquant-") and built[0].endswith(".so")
    stamp = (fresh_kernels / built[0]).stat().st_mtime_ns
    native.kernels.cache_clear()
    assert native.kernels() is not None
    assert (fresh_kernels / built[0]).stat().st_mtime_ns == stamp  # not built again


def test_off_or_no_compiler_falls_back_and_leaves_nothing(
    fresh_kernels, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert native.kernels() is None and native.spectrum_kernels() is None
    monkeypatch.delenv(native.NATIVE_ENV)
    native.kernels.cache_clear()
    native.spectrum_kernels.cache_clear()
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails every build
    assert native.kernels() is None and native.spectrum_kernels() is None
    left = list(fresh_kernels.iterdir()) if fresh_kernels.exists() else []
    assert left == []  # no half-written library
    native.kernels.cache_clear()
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert native.kernels() is None


@pytest.mark.parametrize("bits", [1, 4])
def test_three_ranks_stages_equal_the_torch_path(
    library, bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """The owner's average of more than two copies: per-copy kernels, torch's sum."""
    from superneurons.codecs import twophase_stages as stages
    from superneurons.codecs.twophase import TwoPhase

    config = TwoPhase(bits=bits, chunk=COLS)
    layout = config.layout(COLS * 30, 3)

    def run() -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(layout.padded_numel, generator=gen).view(-1, COLS)
        x[3] = -0.0
        scratch = stages.StageScratch.make(
            layout, lambda _, n, d: torch.empty(n, dtype=d), torch.device("cpu")
        )
        message = torch.zeros(3, layout.slice_bytes, dtype=torch.uint8)
        error = torch.empty_like(x)
        stages.worker_encode(x, message, layout, config, scratch, residual=None, error=error)
        owned = torch.zeros(1, layout.slice_bytes, dtype=torch.uint8)
        residual = torch.randn(layout.rows, COLS, generator=gen)
        owner_error, decoded = torch.empty(layout.rows, COLS), torch.empty(layout.rows, COLS)
        stages.owner_reduce(
            message, owned, layout, config, scratch, residual=residual, error=owner_error,
            decoded=decoded,
        )  # fmt: skip
        rows = torch.empty_like(x)
        stages.decode_slices(message, rows, layout, config, scratch)
        floats = [error, owner_error, decoded, rows]
        return [message, owned, *(t.view(torch.int32) for t in floats)]

    with_kernels = run()
    monkeypatch.setattr(stages.native, "kernels", lambda: None)
    for got, want in zip(with_kernels, run(), strict=True):
        assert torch.equal(got, want)


def test_no_home_for_the_cache_falls_back(fresh_kernels, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("SUPERNEURONS_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(native.Path, "home", staticmethod(no_home))
    assert native.kernels() is None


def _hard_spectrum(rows: int, bins: int) -> torch.Tensor:
    """complex64 ``(rows, bins)`` with the values that break a score: signed zeros,
    subnormals, squares that overflow, ties, NaN and inf."""
    gen = torch.Generator().manual_seed(bins)
    parts = torch.randn(rows, bins, 2, generator=gen)
    parts[0] = 0.0
    parts[1, ::2] = -0.0
    parts[2] *= 1e-22  # squares subnormal or zero
    parts[3, :4] = 3e19  # squares overflow to inf
    parts[4] = 0.5  # ties at the threshold
    parts[5, bins // 2, 0] = float("nan")
    parts[6, bins - 1, 1] = float("-inf")
    return torch.view_as_complex(parts)


@pytest.mark.parametrize("length", [512, 300, 301, 1])
def test_spectrum_candidates_equal_the_numpy_scan(length: int) -> None:
    """The FFT codec's fused candidate pass (spectrum.c) finds the numpy scan's positions,
    scores and values, bit for bit, block by block; and both give up past the same limit."""
    from superneurons.codecs.sparse import blocks

    library = native.spectrum_kernels()
    if library is None:
        pytest.skip("no C compiler here: the kernels cannot be built")
    bins = length // 2 + 1
    spectrum = _hard_spectrum(40, bins)

    def rows(start: int, stop: int) -> torch.Tensor:  # irfft's rows give back these bins
        return torch.fft.irfft(spectrum[start:stop], n=length)

    blocked_spectrum = torch.fft.rfft(rows(0, 40))
    scores = torch.view_as_real(blocked_spectrum).square().sum(-1)
    for low in (0.0, float(scores.nan_to_num().median()), 0.25):
        low32 = torch.tensor(low, dtype=torch.float32).numpy()
        want = blocks._scan_numpy(rows, length, 40, low32, 10**6)
        got = blocks._scan_native(library, rows, length, 40, low32, 10**6)
        assert want is not None and got is not None
        assert np.array_equal(got[0], want[0])
        assert np.array_equal(got[1].view(np.int32), want[1].view(np.int32))
        got_values, want_values = np.concatenate(got[2]), np.concatenate(want[2])
        assert np.array_equal(got_values.view(np.int64), want_values.view(np.int64))
        limit = max(0, want[0].size - 1)  # one candidate too many: both give up
        assert blocks._scan_numpy(rows, length, 40, low32, limit) is None
        assert blocks._scan_native(library, rows, length, 40, low32, limit) is None


def test_fft_payloads_are_the_same_with_and_without_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from superneurons.codecs.sparse import blocks
    from superneurons.compress import parse_spec

    if native.spectrum_kernels() is None:
        pytest.skip("no C compiler here: the kernels cannot be built")
    monkeypatch.setattr(blocks, "_BLOCK_VALUES", 1 << 12)  # many blocks
    gen = torch.Generator().manual_seed(5)
    grad = torch.randn(400_003, generator=gen) * torch.rand(400_003, generator=gen)
    grad[1000:3000] = 0.0
    specs = ["fft", "fft:chunk=300", "fft:theta=0.99,index=bitmap", "fft:bits=32"]
    with_kernel = [parse_spec(spec).encode(grad).data for spec in specs]
    monkeypatch.setattr(native, "spectrum_kernels", lambda: None)
    for spec, got in zip(specs, with_kernel, strict=True):
        assert torch.equal(got, parse_spec(spec).encode(grad).data), spec


def test_the_candidate_kernel_refuses_a_spectrum_of_another_length() -> None:
    library = native.spectrum_kernels()
    if library is None:
        pytest.skip("no C compiler here: the kernels cannot be built")
    room = torch.empty(8, dtype=torch.int64)
    with pytest.raises(ValueError, match="length 512"):
        native.spectrum_candidates_into(
            library, torch.zeros(2, 100, dtype=torch.complex64), length=512, low=0.0, base=0,
            positions=room, scores=torch.empty(8), values=torch.empty(8, dtype=torch.complex64),
        )  # fmt: skip


def _hard_values() -> torch.Tensor:
    """float32 values that break a range-float quantiser: signed zeros, subnormals, values on
    rounding midpoints, the window's edges, huge values, inf and NaN."""
    gen = torch.Generator().manual_seed(11)
    parts = [
        torch.randn(5000, generator=gen),
        torch.randn(500, generator=gen) * 1e-40,  # subnormals
        torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38, 1.5, -1.5, 2.0**-126]),
        torch.arange(-600, 600, dtype=torch.float32) / 256,  # many midpoints
        torch.randn(500, generator=gen).mul(2.0).exp2() * torch.randn(500, generator=gen),
    ]
    return torch.cat(parts)


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_rangefloat_codes_equal_the_torch_sequence(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The range-float kernel (rangefloat.c) gives quantize's codes bit for bit, for windows
    chosen by a threshold and by the error estimate, finite or not."""
    from superneurons.codecs.coding import rangefloat

    if native.rangefloat_kernels() is None:
        pytest.skip("no C compiler here: the kernels cannot be built")
    values = _hard_values()
    cases = [(values, t) for t in (None, 1e-30, 1e-3, 0.5, 10.0)]
    cases += [(values * 1e-38, None), (values * 1e30, 1.0)]
    for bad in (float("inf"), float("nan")):
        broken = values.clone()
        broken[7] = bad
        cases.append((broken, 1e-3))

    def run() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        out = []
        for x, threshold in cases:
            codes, header = rangefloat.quantize(x, bits, threshold=threshold)
            out.append((codes, header.max_bits, header.exp_bits))
        return out

    with_kernel = run()
    monkeypatch.setattr(native, "rangefloat_kernels", lambda: None)
    for (got, *got_header), (want, *want_header) in zip(with_kernel, run(), strict=True):
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(got_header, want_header, strict=True))


@pytest.mark.parametrize("universe", [1, 63, 64, 65, 1000, 70_001])
def test_gap_code_equals_the_numpy_path(universe: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Elias-Fano coder (gapcode.c) writes the numpy path's bytes and lists its positions
    for every low width the code picks (densities from one position to all), and refuses a bitmap that
    holds another number of positions."""
    from superneurons.codecs.coding import indexcode
    from superneurons.errors import ConfigError

    if native.gapcode_kernels() is None:
        pytest.skip("no C compiler here: the kernels cannot be built")
    gen = torch.Generator().manual_seed(universe)
    widths = set()

    def widths_last(count: int) -> int:
        return indexcode.gap_low_bits(universe, count)

    shares = (300, 17, 6, 3, 2, 1)  # universe / count: low widths 8, 4, 2, 1, 0, 0 at 70,001
    for count in sorted({1, 2, 5000, *(universe // share for share in shares)}):
        count = max(1, min(count, universe))
        indices = torch.randperm(universe, generator=gen)[:count].sort().values
        data = indexcode.encode_gap(indices, universe)
        widths.add(indexcode.gap_low_bits(universe, count))
        got = indexcode.decode_gap(data, universe, count)
        with monkeypatch.context() as patch:
            patch.setattr(native, "gapcode_kernels", lambda: None)
            want = indexcode.decode_gap(data, universe, count)
            assert torch.equal(indexcode.encode_gap(indices, universe), data)  # the same bytes
        assert torch.equal(got, want) and torch.equal(got, indices)
        empty = data.clone()
        empty[-indexcode.bitmap_bytes(count + ((universe - 1) >> widths_last(count)) + 1) :] = 0
        with pytest.raises(ConfigError, match="gap code"):  # no position in the bitmap
            indexcode.decode_gap(empty, universe, count)
    with pytest.raises(ConfigError, match="outside"):  # a position beyond the universe
        indexcode.encode_gap(torch.tensor([0, 4 * universe + (1 << 20)]), universe)
    if universe == 70_001:
        assert widths == {0, 1, 2, 4, 8, 16}, widths  # every width was exercised


@pytest.mark.parametrize("divisor", [1, 2, 3, 7])
def test_fft_decodes_are_the_same_with_and_without_the_kernels(
    divisor: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The FFT decoder's scatter and writes (spectrum.c) give the torch path's bits: a sum, an
    average over ``divisor`` ranks into a buffer, a residual less a decode (signed zeros
    included), across many blocks."""
    from superneurons.codecs.codec import decode_mean_into, subtract_decode
    from superneurons.codecs.sparse import blocks
    from superneurons.compress import parse_spec

    if native.spectrum_kernels() is None:
        pytest.skip("no C compiler here: the kernels cannot be built")
    monkeypatch.setattr(blocks, "_BLOCK_VALUES", 1 << 12)
    codec = parse_spec("fft:chunk=300")
    gen = torch.Generator().manual_seed(divisor)
    grads = [torch.randn(200_003, generator=gen) for _ in range(3)]
    grads[0][:5000] = 0.0  # rows of zeros decode to signed zeros
    payloads = [codec.encode(g) for g in grads]
    residual = torch.randn(200_003, generator=gen)
    residual[:100] = -0.0

    def run() -> list[torch.Tensor]:
        total = codec.decode_sum(payloads)
        mean = decode_mean_into(codec, payloads, torch.full_like(total, 7.0), divisor)
        less = subtract_decode(codec, payloads[0], residual.clone())
        return [t.view(torch.int32) for t in (total, mean, less)]

    with_kernels = run()
    monkeypatch.setattr(native, "spectrum_kernels", lambda: None)
    for got, want in zip(with_kernels, run(), strict=True):
        assert torch.equal(got, want)
