"""The fused quantisation kernels (codecs/coding/native.py, rowquant.c) write the bits of the
torch sequence they replace, on values chosen to break them (signed zeros, subnormals, a scale
whose double overflows, all-zero rows), and build or step aside cleanly."""

from __future__ import annotations

from pathlib import Path

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
    yield tmp_path / "cache"
    native.kernels.cache_clear()


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
    assert native.kernels() is None
    monkeypatch.delenv(native.NATIVE_ENV)
    native.kernels.cache_clear()
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails every build
    assert native.kernels() is None
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
