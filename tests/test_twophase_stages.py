"""The two-phase stages in row blocks (codecs/twophase_stages.py) give the bits of the unblocked
sequence they replaced (quantise everything, dequantise, subtract, pack; read, sum, average,
re-quantise), at every width and rounding, across many blocks, and with a non-finite value; by
the fused kernels and by the torch path alike."""

from __future__ import annotations

import pytest
import torch

from superneurons.codecs import twophase_stages as stages
from superneurons.codecs.coding.chunkquant import (
    dequantize_rows,
    quantize_rows,
    read_rows,
    write_rows_,
)
from superneurons.codecs.twophase import TwoPhase

_WORLD = 2


@pytest.fixture(params=["kernels", "torch"], autouse=True)
def quantiser_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test on both CPU paths: the fused kernels (codecs/coding/native.py) and the torch
    sequence they stand in for where they cannot be built."""
    if request.param == "torch":
        monkeypatch.setattr(stages.native, "kernels", lambda: None)
    elif stages.native.kernels() is None:
        pytest.skip("no C compiler here: the kernels cannot be built")
    return str(request.param)


def _fresh(_: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((numel,), 7, dtype=dtype)  # garbage-filled: nothing may rely on zeros


def _reference_worker(x, residual, config, layout, generator):  # type: ignore[no-untyped-def]
    rows = (x + residual).view(-1, layout.cols)
    codes, scales = quantize_rows(
        rows, bits=config.bits, rounding=config.rounding, generator=generator
    )
    finite = bool(torch.isfinite(scales).all())
    error = rows - dequantize_rows(codes, scales, bits=config.bits)
    if not finite:
        scales.fill_(float("nan"))
        codes.zero_()
    message = torch.zeros(_WORLD, layout.slice_bytes, dtype=torch.uint8)
    write_rows_(
        codes.view(_WORLD, layout.rows, layout.cols),
        scales.view(_WORLD, layout.rows),
        bits=config.bits,
        out=message,
    )
    return message, error, finite


def _reference_owner(received, residual, config, layout, generator):  # type: ignore[no-untyped-def]
    copies = torch.empty(_WORLD * layout.rows, layout.cols)
    read_rows(received, layout.rows, layout.cols, bits=config.bits, out=copies)
    average = torch.sum(copies.view(_WORLD, -1), dim=0).div_(_WORLD).add_(residual)
    rows = average.view(layout.rows, layout.cols)
    codes, scales = quantize_rows(
        rows, bits=config.bits, rounding=config.rounding, generator=generator
    )
    error = rows - dequantize_rows(codes, scales, bits=config.bits)
    owned = torch.zeros(1, layout.slice_bytes, dtype=torch.uint8)
    write_rows_(codes.view(1, layout.rows, -1), scales.view(1, -1), bits=config.bits, out=owned)
    return owned, error


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_blocked_stages_equal_the_unblocked_sequence(
    bits: int, rounding: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stages, "BLOCK_VALUES", 3 * 64)  # 3 rows of 64 per block: many blocks
    config = TwoPhase(bits=bits, chunk=64, rounding=rounding)
    layout = config.layout(64 * 40, _WORLD)  # 20 rows per slice: blocks of 3 leave a rest
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(layout.padded_numel, generator=gen)
    x[70:134] = -0.0  # a row of -0: the scale's sign of zero must survive blocking
    residual = torch.randn(layout.padded_numel, generator=gen) * 0.1
    want, want_error, _ = _reference_worker(
        x, residual, config, layout, torch.Generator().manual_seed(5)
    )
    scratch = stages.StageScratch.make(layout, _fresh, torch.device("cpu"))
    message = torch.zeros(_WORLD, layout.slice_bytes, dtype=torch.uint8)
    error = torch.empty(layout.padded_numel)
    rows = x.clone().view(-1, layout.cols)
    assert stages.worker_encode(
        rows,
        message,
        layout,
        config,
        scratch,
        residual=residual.view_as(rows),
        error=error.view_as(rows),
        generator=torch.Generator().manual_seed(5),
    )
    assert torch.equal(rows.reshape(-1), x)  # the input is read only
    assert torch.equal(message, want)
    assert torch.equal(error.view(torch.int32), want_error.reshape(-1).view(torch.int32))

    owner_residual = torch.randn(layout.slice_numel, generator=gen) * 0.1
    want_owned, want_owner_error = _reference_owner(
        message, owner_residual, config, layout, torch.Generator().manual_seed(6)
    )
    owned = torch.zeros(1, layout.slice_bytes, dtype=torch.uint8)
    owner_error = torch.empty(layout.rows, layout.cols)
    shape = (layout.rows, layout.cols)
    assert stages.owner_reduce(
        message,
        owned,
        layout,
        config,
        scratch,
        residual=owner_residual.view(shape),
        error=owner_error,
        generator=torch.Generator().manual_seed(6),
    )
    assert torch.equal(owned, want_owned)
    assert torch.equal(owner_error.view(torch.int32), want_owner_error.view(torch.int32))

    decoded = torch.empty(_WORLD * layout.rows, layout.cols)
    stages.decode_slices(message, decoded, layout, config, scratch)
    want_decoded = torch.empty_like(decoded)
    read_rows(message, layout.rows, layout.cols, bits=bits, out=want_decoded)
    assert torch.equal(decoded.view(torch.int32), want_decoded.view(torch.int32))


def test_a_non_finite_value_makes_the_message_nan_and_keeps_no_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(stages, "BLOCK_VALUES", 2 * 64)
    config = TwoPhase(bits=4, chunk=64)
    layout = config.layout(64 * 12, _WORLD)
    x = torch.randn(layout.padded_numel, generator=torch.Generator().manual_seed(1))
    x[500] = float("inf")
    want, _, finite = _reference_worker(x, torch.zeros_like(x), config, layout, None)
    assert not finite
    message = torch.full((_WORLD, layout.slice_bytes), 3, dtype=torch.uint8)
    scratch = stages.StageScratch.make(layout, _fresh, torch.device("cpu"))
    rows = x.view(-1, layout.cols)
    got = stages.worker_encode(rows, message, layout, config, scratch, residual=None, error=None)
    assert not got
    heads = message[:, : 4 * layout.rows].view(torch.float32)
    assert torch.isnan(heads).all()
    assert torch.equal(message[:, 4 * layout.rows :], want[:, 4 * layout.rows :])


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("with_error", [True, False])
def test_the_owners_decode_of_its_slice_equals_the_decode_of_its_segment(
    bits: int, rounding: str, with_error: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``owner_reduce(decoded=...)`` writes the bits ``decode_slices`` would write for the owned
    segment (so the hook skips it there), and the same error and message as without it."""
    monkeypatch.setattr(stages, "BLOCK_VALUES", 3 * 64)
    config = TwoPhase(bits=bits, chunk=64, rounding=rounding)
    layout = config.layout(64 * 40, _WORLD)
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(layout.padded_numel, generator=gen)
    scratch = stages.StageScratch.make(layout, _fresh, torch.device("cpu"))
    message = torch.zeros(_WORLD, layout.slice_bytes, dtype=torch.uint8)
    rows = x.view(-1, layout.cols)
    stages.worker_encode(rows, message, layout, config, scratch, residual=None, error=None)
    residual = torch.randn(layout.rows, layout.cols, generator=gen) * 0.1
    results = []
    for decoded in (None, torch.full((layout.rows, layout.cols), 7.0)):
        owned = torch.zeros(1, layout.slice_bytes, dtype=torch.uint8)
        error = torch.empty(layout.rows, layout.cols) if with_error else None
        assert stages.owner_reduce(
            message, owned, layout, config, scratch, residual=residual, error=error,
            generator=torch.Generator().manual_seed(6), decoded=decoded,
        )  # fmt: skip
        results.append((owned, error, decoded))
    (owned, error, _), (owned_too, error_too, decoded) = results
    assert torch.equal(owned, owned_too) and decoded is not None
    if error is not None and error_too is not None:
        assert torch.equal(error.view(torch.int32), error_too.view(torch.int32))
    gathered = owned.expand(_WORLD, -1).contiguous()  # every owner's segment: this one
    want = torch.empty(_WORLD * layout.rows, layout.cols)
    stages.decode_slices(gathered, want, layout, config, scratch)
    assert torch.equal(decoded.view(torch.int32), want[: layout.rows].view(torch.int32))
    skipped = torch.full_like(want, 5.0)
    stages.decode_slices(gathered, skipped, layout, config, scratch, skip=0)
    assert (skipped[: layout.rows] == 5.0).all()
    assert torch.equal(skipped[layout.rows :], want[layout.rows :])


@pytest.mark.parametrize("bits", [1, 4, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_stages_in_row_windows_equal_the_whole_tensor(bits: int, rounding: str) -> None:
    """Each stage run on windows of rows (the waves of an exchange: rows of every slice at a
    time, one rounding key for the tensor) writes the bits of one call on every row."""
    from superneurons.codecs.twophase import SliceLayout

    config = TwoPhase(bits=bits, chunk=64, rounding=rounding)
    layout = config.layout(64 * 46, _WORLD)  # 23 rows per slice
    rows, cols = layout.rows, layout.cols
    x = torch.randn(_WORLD, rows, cols, generator=torch.Generator().manual_seed(bits))
    residual = torch.randn(_WORLD, rows, cols, generator=torch.Generator().manual_seed(9)) / 8
    owner_residual = torch.randn(rows, cols, generator=torch.Generator().manual_seed(3)) / 8
    windows = [(0, 5), (5, 6), (6, 17), (17, 23)]

    def sub(count: int) -> SliceLayout:
        return SliceLayout(_WORLD * count * cols, _WORLD, count * cols, cols, bits)

    def key(seed: int) -> object:
        return stages.rounding_key(config, torch.Generator().manual_seed(seed), x.device)

    # one call on the whole tensor
    message = torch.zeros(_WORLD, layout.slice_bytes, dtype=torch.uint8)
    error = torch.zeros_like(x)
    window = stages.RowWindow(0, rows, key(1))
    stages.worker_encode(
        x, message, layout, config, stages.StageScratch.make(layout, _fresh, x.device),
        residual=residual, error=error, window=window,
    )  # fmt: skip
    owned = torch.zeros(1, layout.slice_bytes, dtype=torch.uint8)
    owner_error, decoded = torch.zeros(rows, cols), torch.zeros(rows, cols)
    stages.owner_reduce(
        message, owned, layout, config, stages.StageScratch.make(layout, _fresh, x.device),
        residual=owner_residual, error=owner_error, decoded=decoded,
        window=stages.RowWindow(0, rows, key(2)),
    )  # fmt: skip
    whole = torch.zeros_like(x)
    stages.decode_slices(
        message, whole, layout, config, stages.StageScratch.make(layout, _fresh, x.device)
    )
    # the same rows, window by window
    error_w, owner_error_w = torch.zeros_like(x), torch.zeros(rows, cols)
    decoded_w, whole_w = torch.zeros(rows, cols), torch.zeros_like(x)
    worker_key, owner_key = key(1), key(2)
    for first, stop in windows:
        part = sub(stop - first)
        scratch = stages.StageScratch.make(part, _fresh, x.device)
        piece = torch.zeros(_WORLD, part.slice_bytes, dtype=torch.uint8)
        stages.worker_encode(
            x[:, first:stop], piece, part, config, scratch,
            residual=residual[:, first:stop], error=error_w[:, first:stop],
            window=stages.RowWindow(first, rows, worker_key),
        )  # fmt: skip
        mine = torch.zeros(1, part.slice_bytes, dtype=torch.uint8)
        stages.owner_reduce(
            piece, mine, part, config, scratch,
            residual=owner_residual[first:stop], error=owner_error_w[first:stop],
            decoded=decoded_w[first:stop], window=stages.RowWindow(first, rows, owner_key),
        )  # fmt: skip
        stages.decode_slices(piece, whole_w[:, first:stop], part, config, scratch)
    for a, b in ((error, error_w), (owner_error, owner_error_w), (decoded, decoded_w)):
        assert torch.equal(a, b)
    assert torch.equal(whole, whole_w)
