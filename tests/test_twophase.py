"""The two-phase compressed all-reduce: the quantiser and transforms alone, then the transport
on 2, 3 and 4 gloo ranks (one group per world size runs every case in one call)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from distributed import shared_ranks
from superneurons.codecs.coding.bitpack import pack_bits
from superneurons.codecs.coding.chunkquant import (
    dequantize_rows,
    quantize_rows,
    quantized_bytes,
    read_rows,
    write_rows_,
)
from superneurons.codecs.coding.orthogonal import forward_, inverse_, rademacher
from superneurons.codecs.twophase import TwoPhase
from superneurons.errors import ConfigError

_CPU = torch.device("cpu")
# odd sizes, sizes below one chunk per rank, and chunk counts that do not divide P
_SIZES = (1, 7, 100, 513, 1000, 4099)


# -- the quantiser ---------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_nearest_rounding_error_is_at_most_half_a_step(bits: int) -> None:
    x = torch.randn(16, 64)
    codes, scales = quantize_rows(x, bits=bits, rounding="nearest")
    assert int(codes.max()) <= 2**bits - 1
    decoded = dequantize_rows(codes, scales, bits=bits)
    if bits == 1:  # the scaled sign of EF-signSGD: mean |x| per chunk
        torch.testing.assert_close(scales, x.abs().mean(dim=1))
        torch.testing.assert_close(decoded, torch.where(x >= 0, 1.0, -1.0) * scales[:, None])
        return
    step = 2 * scales / (2**bits - 1)
    assert bool(((decoded - x).abs() <= step[:, None] / 2 * (1 + 1e-5)).all())


def test_one_bit_scales_sum_magnitudes_closer_than_a_sequential_sum() -> None:
    """The scaled sign's scale is torch's sum of ``|x|`` over the row / cols (bitwise), and
    its codes are ``x >= 0`` (-0.0 is non-negative); that sum is nearer the float64 sum than
    adding the row's values one after another (``vector_norm(ord=1)``'s order)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2048, 512, generator=gen) * torch.exp(2 * torch.randn(2048, 512, generator=gen))
    x[0, :5] = torch.tensor([-0.0, 0.0, -1e-30, 1e-30, -5.0])
    codes, scales = quantize_rows(x, bits=1, rounding="nearest")
    assert torch.equal(codes.bool(), x >= 0) and bool(codes[0, 0])
    assert torch.equal(scales, x.abs().sum(dim=1) / 512)
    exact = x.double().abs().sum(dim=1)
    ours = (scales.double() * 512 - exact).abs().mean()
    sequential = (torch.linalg.vector_norm(x, ord=1, dim=1).double() - exact).abs().mean()
    assert ours < sequential / 2


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_stochastic_rounding_is_unbiased(bits: int) -> None:
    x = torch.randn(4, 32)
    draws = 4000  # every row repeated: the counter-based noise differs per position
    gen = torch.Generator().manual_seed(0)
    codes, scales = quantize_rows(
        x.repeat(draws, 1), bits=bits, rounding="stochastic", generator=gen
    )
    mean = dequantize_rows(codes, scales, bits=bits).view(draws, 4, 32).mean(0)
    step = 2 * x.abs().amax(dim=1, keepdim=True) / (2**bits - 1)
    # each draw lies within one step of x: the mean's standard error is <= step / (2 sqrt(n))
    assert bool(((mean - x).abs() <= 4 * step / (2 * math.sqrt(draws))).all())


def test_write_read_round_trip_through_strided_segments() -> None:
    x = torch.randn(3 * 5, 24)
    for bits in (1, 2, 4, 8):
        codes, scales = quantize_rows(x, bits=bits, rounding="nearest")
        decoded = dequantize_rows(codes, scales, bits=bits)
        original = codes.clone()  # write_rows_ packs in place
        nbytes = quantized_bytes(5, 24, bits)
        width = 8 + -(-nbytes // 4) * 4 + 4  # other parts around it, rows 4-byte aligned
        message = torch.zeros(3, width, dtype=torch.uint8)
        write_rows_(
            codes.view(3, 5, 24), scales.view(3, 5), bits=bits, out=message[:, 8 : 8 + nbytes]
        )
        out = torch.empty(15, 24)
        read_rows(message[:, 8 : 8 + nbytes], 5, 24, bits=bits, out=out)
        assert torch.equal(out, decoded)
        for block in range(3):  # the byte-operation packing is bitpack's layout
            expected = pack_bits(original.view(3, -1)[block], bits)
            assert torch.equal(message[block, 8 + 4 * 5 : 8 + nbytes], expected)
        assert int(message[:, :8].sum()) == 0 and int(message[:, 8 + nbytes :].sum()) == 0


# -- the transforms ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["hadamard", "dct"])
@pytest.mark.parametrize("k", [8, 64, 512])
def test_transform_is_orthogonal_and_inverted(kind: str, k: int) -> None:
    x = torch.randn(6, k)
    signs = rademacher(3, "fc.weight", k, _CPU)
    y = forward_(x.clone(), kind, signs)
    torch.testing.assert_close(y.norm(dim=1), x.norm(dim=1))  # Parseval, row by row
    torch.testing.assert_close(inverse_(y.clone(), kind, signs), x, atol=1e-5, rtol=1e-5)
    # linear: the transform of a sum is the sum of transforms (what lets owners average)
    z = torch.randn(6, k)
    torch.testing.assert_close(
        forward_(x + z, kind, signs), y + forward_(z.clone(), kind, signs), atol=1e-5, rtol=1e-5
    )


def test_dct_matches_the_matrix_definition() -> None:
    k = 16
    x = torch.randn(3, k, dtype=torch.float64)
    n = torch.arange(k, dtype=torch.float64)
    basis = torch.cos(math.pi * (2 * n + 1) * n[:, None] / (2 * k)) * math.sqrt(2 / k)
    basis[0] /= math.sqrt(2)
    ones = torch.ones(k)
    got = forward_(x.float().clone(), "dct", ones)
    torch.testing.assert_close(got.double(), x @ basis.t(), atol=1e-5, rtol=1e-5)


def test_transform_signs_are_shared_by_seed_and_name() -> None:
    a = rademacher(0, "fc.weight", 64, _CPU)
    assert torch.equal(a, rademacher(0, "fc.weight", 64, _CPU))
    assert not torch.equal(a, rademacher(1, "fc.weight", 64, _CPU))
    assert not torch.equal(a, rademacher(0, "fc.bias", 64, _CPU))
    assert set(a.tolist()) == {-1.0, 1.0}


# -- the config and the layout -------------------------------------------------------------
def test_layout_covers_every_value_with_byte_aligned_slices() -> None:
    for config in (TwoPhase(bits=4, chunk=64), TwoPhase(bits=1, chunk=64, transform="hadamard")):
        for numel in _SIZES:
            for world_size in (1, 2, 3, 4, 8):
                layout = config.layout(numel, world_size)
                assert layout.padded_numel >= numel
                assert layout.slice_numel % layout.cols == 0
                assert layout.slice_numel * config.bits % 8 == 0
                assert layout.slice_bytes % 4 == 0
                if config.transform == "hadamard":
                    assert layout.cols & (layout.cols - 1) == 0
                # the padding is less than one chunk per slice
                assert layout.padded_numel - numel < world_size * layout.cols + world_size
                assert (
                    layout.slice_bytes
                    == -(-(4 * layout.rows + layout.slice_numel * config.bits // 8) // 4) * 4
                )


def test_bytes_per_rank_do_not_grow_with_the_world_size() -> None:
    """All-to-all (P segments) + all-gather (one): n (b/8 + 4/chunk) (1 + 1/P) bytes of input
    (codes and one fp32 scale per chunk), up to the padding of less than a chunk per slice."""
    config = TwoPhase(bits=4)
    numel = 25_000_000
    for p in (2, 8, 64, 512):
        nbytes = (p + 1) * config.message_bytes([numel], p)
        assert nbytes / ((1 + 1 / p) * numel * (4 / 8 + 4 / 512)) == pytest.approx(1.0, abs=0.01)


def test_bad_configs_say_what_to_do() -> None:
    for kwargs in (
        {"bits": 3},
        {"bits": 16},
        {"chunk": 12},
        {"chunk": 4},
        {"chunk": 96, "transform": "hadamard"},
    ):
        with pytest.raises(ConfigError):
            TwoPhase(**kwargs)  # type: ignore[arg-type]


# -- the transport on gloo ranks -----------------------------------------------------------
def _grad(rank: int, numel: int, step: int, *, integers: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + numel)
    if integers:  # exact sums in any order: bitwise comparable with a ring all-reduce
        return torch.randint(-64, 64, (numel,), generator=gen).float()
    return torch.randn(numel, generator=gen) * (1 + rank)


def _generators(rank: int, step: int) -> Any:
    import zlib

    return lambda key: torch.Generator().manual_seed(zlib.crc32(f"{rank}/{step}/{key}".encode()))


def _transport_cases(rank: int, world_size: int) -> dict[str, Any]:
    from superneurons.ddp.twophase import TwoPhaseState, average_, exchange

    out: dict[str, Any] = {}
    # 1. lossless at 32 bits equals a plain all-reduce (odd sizes, several tensors at once)
    for transform in ("none", "hadamard", "dct"):
        config = TwoPhase(bits=32, chunk=64, transform=transform)
        grads = [_grad(rank, n, 0, integers=True) for n in _SIZES]
        mine = [g.clone() for g in grads]
        average_(
            [(f"p{n}", g, config) for n, g in zip(_SIZES, mine, strict=True)], TwoPhaseState(seed=1)
        )
        reference = [g.clone() for g in grads]
        for g in reference:
            dist.all_reduce(g)
            g.div_(world_size)
        out[f"lossless/{transform}"] = (mine, reference)
    # 2. bytes sent = the payload formula; the buffers have exactly that size
    config = TwoPhase(bits=4, chunk=64)
    state = TwoPhaseState()
    tensors = [(f"p{n}", _grad(rank, n, 0), config) for n in _SIZES]
    started = exchange(tensors, state, group=None, error_feedback=True)
    started.future.wait()
    started.finish()
    segment = sum(config.layout(n, world_size).slice_bytes for n in _SIZES)
    out["bytes"] = (
        started.bytes_sent,
        (world_size + 1) * segment,
        config.message_bytes(list(_SIZES), world_size),
    )
    wire = ("send", "received", "owned", "gathered")  # what the collectives move
    out["buffers"] = sorted(t.numel() for k, t in state._buffers.items() if k[0] in wire)
    out["segment"] = segment
    # 3. error feedback at both stages, carried across steps; identical results on every rank
    for spec in (
        "twophase:bits=4,chunk=64",
        "twophase:bits=1,chunk=64",
        "twophase:bits=2,chunk=64,rounding=stochastic,transform=hadamard",
        "twophase:bits=4,chunk=64,transform=dct",
    ):
        from superneurons.schemes.grammar import parse_spec

        config = parse_spec(spec)  # type: ignore[assignment]
        state = TwoPhaseState(seed=7)
        fixed = {n: _grad(rank, n, 0) for n in (513, 1000)}
        outputs, worker_max, owner_max = [], [], []
        for step in range(12):
            tensors = [(f"p{n}", g.clone(), config) for n, g in fixed.items()]
            average_(tensors, state, generators=_generators(rank, step))
            outputs.append([t for _, t, _ in tensors])
            worker_max.append(max(float(r.abs().max()) for r in state.worker.values()))
            owner_max.append(max(float(r.abs().max()) for r in state.owner.values()))
        true = []
        for g in fixed.values():
            total = g.clone()
            dist.all_reduce(total)
            true.append(total / world_size)
        # what every rank still owes, averaged (release: worker + P * owned slice, inverted)
        owed = []
        for n in fixed:
            mine = state.release(f"p{n}", n, rank)
            assert mine is not None
            dist.all_reduce(mine)
            owed.append(mine / world_size)
        out[f"ef/{spec}"] = {
            "outputs": outputs,
            "true": true,
            "owed": owed,
            "worker_max": worker_max,
            "owner_max": owner_max,
            "grad_max": max(float(g.abs().max()) for g in fixed.values()),
            "bits": config.bits,
        }
    # 4. state_dict round trip: resume continues bit for bit
    config = TwoPhase(bits=2, chunk=64, rounding="stochastic", transform="hadamard")
    runs = []
    for resume in (False, True):
        state = TwoPhaseState(seed=3)
        results = []
        for step in range(6):
            if resume and step == 3:
                saved = state.state_dict()
                state = TwoPhaseState(seed=0)
                state.load_state_dict(saved)
            tensors = [(f"p{n}", _grad(rank, n, step), config) for n in (100, 4099)]
            average_(tensors, state, generators=_generators(rank, step))
            results.append([t.clone() for _, t, _ in tensors])
        runs.append(results)
    out["resume"] = runs
    # 5. a non-finite value on one rank makes that tensor NaN on every rank, residuals kept
    config = TwoPhase(bits=4, chunk=64)
    state = TwoPhaseState()
    average_([("a", _grad(rank, 1000, 0), config), ("b", _grad(rank, 100, 0), config)], state)
    before = {k: v.clone() for k, v in state.worker.items()}
    bad = _grad(rank, 1000, 1)
    if rank == world_size - 1:
        bad[5] = float("inf")
    tensors = [("a", bad, config), ("b", _grad(rank, 100, 1), config)]
    average_(tensors, state)
    out["nonfinite"] = (
        bool(torch.isnan(tensors[0][1]).all()),
        bool(torch.isfinite(tensors[1][1]).all()),
        torch.equal(state.worker["a"], before["a"]) if rank == world_size - 1 else True,
    )
    # 6. what a route switch owes: release() returns worker + P * owner (in the gradient's domain)
    config = TwoPhase(bits=1, chunk=64, transform="dct")
    state = TwoPhaseState()
    g = _grad(rank, 1000, 0)
    tensors = [("w", g.clone(), config)]
    average_(tensors, state)
    owed = state.release("w", 1000, rank)
    assert owed is not None and "w" not in state.worker and "w" not in state.owner
    total = g.clone()
    dist.all_reduce(total)
    total.div_(world_size)
    owed_avg = owed.clone()
    dist.all_reduce(owed_avg)
    owed_avg.div_(world_size)
    # the result plus what everyone still owes is the true average
    out["release"] = (tensors[0][1] + owed_avg, total)
    return out


@pytest.mark.dist
# four ranks: ~23 s of CPU (each rank starts and imports torch)
@pytest.mark.parametrize("world_size", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_transport_on_gloo_ranks(world_size: int) -> None:
    results = shared_ranks(world_size).run(_transport_cases, timeout_s=180)
    for rank, got in enumerate(results):
        for transform in ("none", "hadamard", "dct"):
            mine, reference = got[f"lossless/{transform}"]
            for a, b in zip(mine, reference, strict=True):
                if transform == "none":
                    assert torch.equal(a, b), (rank, transform)
                else:  # the transform's own float rounding
                    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
        sent, formula, by_config = got["bytes"]
        assert sent == formula == (world_size + 1) * by_config
        segment = got["segment"]
        assert got["buffers"] == sorted(
            [world_size * segment, world_size * segment, segment, world_size * segment]
        )
        for key, case in got.items():
            if not key.startswith("ef/"):
                continue
            steps = len(case["outputs"])
            # carried across steps, at both stages: T steps of outputs plus what the ranks
            # still owe (worker residuals and owned-slice residuals) is exactly T true averages
            for i, true in enumerate(case["true"]):
                sent = torch.stack([o[i] for o in case["outputs"]]).sum(0)
                torch.testing.assert_close(
                    sent + case["owed"][i], steps * true, atol=1e-3, rtol=1e-4
                )
            # bounded: at most a quantisation step of values EF keeps near the gradient's size;
            # the 1-bit scaled sign contracts weakly (by >= 1/chunk per step, Karimireddy et
            # al. 2019), so its bound is the chunk's length times larger
            bound = 4 * case["grad_max"] * (64 if case["bits"] == 1 else 1)
            for key_max in ("worker_max", "owner_max"):
                assert 0 < max(case[key_max]) <= bound, (key, key_max, case[key_max])
                if case["bits"] > 1:  # no growth once the first steps are over
                    assert max(case[key_max][6:]) <= 1.5 * max(case[key_max][:6]), key
        first, resumed = got["resume"]
        for a, b in zip(first, resumed, strict=True):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y)
        assert got["nonfinite"] == (True, True, True)
        with_owed, true = got["release"]
        torch.testing.assert_close(with_owed, true, atol=1e-5, rtol=1e-5)
    # every rank holds the same average
    for key in results[0]:
        if key.startswith("ef/"):
            for rank in range(1, world_size):
                for a, b in zip(
                    results[0][key]["outputs"], results[rank][key]["outputs"], strict=True
                ):
                    for x, y in zip(a, b, strict=True):
                        assert torch.equal(x, y), key


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_quantiser_and_packing_on_cuda_equal_the_cpu(bits: int) -> None:
    """The same codes, scales and bytes on a GPU (nearest rounding is deterministic); the
    transforms agree to float rounding."""
    cuda = torch.device("cuda")
    x = torch.randn(6 * 4, 64)
    on_cpu = quantize_rows(x, bits=bits, rounding="nearest")
    on_gpu = quantize_rows(x.to(cuda), bits=bits, rounding="nearest")
    assert torch.equal(on_gpu[0].cpu(), on_cpu[0])
    torch.testing.assert_close(on_gpu[1].cpu(), on_cpu[1])
    nbytes = quantized_bytes(4, 64, bits)
    messages = []
    for codes, scales, device in ((*on_cpu, _CPU), (*on_gpu, cuda)):
        message = torch.zeros(6, nbytes, dtype=torch.uint8, device=device)
        write_rows_(codes.view(6, 4, 64), scales.view(6, 4), bits=bits, out=message)
        out = torch.empty(24, 64, device=device)
        read_rows(message, 4, 64, bits=bits, out=out)
        messages.append((message.cpu(), out.cpu()))
    assert torch.equal(messages[0][0][:, 16:], messages[1][0][:, 16:])  # the packed codes
    torch.testing.assert_close(messages[1][1], messages[0][1])
    for kind in ("hadamard", "dct"):
        signs = rademacher(0, "w", 64, _CPU)
        y = forward_(x.clone(), kind, signs)
        got = forward_(x.to(cuda), kind, signs.to(cuda)).cpu()
        torch.testing.assert_close(got, y, atol=1e-5, rtol=1e-5)


def _wave_cases(rank: int, world_size: int) -> dict[str, Any]:
    """The same steps in one wave and in many (``wave_bytes`` far below the sizes)."""
    from superneurons.ddp.twophase import TwoPhaseState, average_
    from superneurons.schemes.grammar import parse_spec

    out: dict[str, Any] = {}
    for spec in (
        "twophase:bits=1,chunk=64",
        "twophase:bits=4,chunk=64",
        "twophase:bits=8,chunk=64",
        "twophase:bits=2,chunk=64,rounding=stochastic,transform=hadamard",
        "twophase:bits=4,chunk=64,transform=dct",
        "twophase:bits=32,chunk=64",
    ):
        config = parse_spec(spec)
        runs = []
        for wave_bytes in (1 << 22, 100):
            state = TwoPhaseState(seed=5)
            outputs, sent = [], []
            for step in range(4):
                tensors = [(f"p{n}", _grad(rank, n, step), config) for n in _SIZES]
                sent.append(
                    average_(
                        tensors,
                        state,
                        generators=_generators(rank, step),
                        wave_bytes=wave_bytes,
                    )  # fmt: skip
                )
                outputs.append([t for _, t, _ in tensors])
            runs.append((outputs, state.state_dict(), sent))
        out[spec] = runs
    # a non-finite value in a late wave of one rank: the whole tensor is NaN on every rank
    config = TwoPhase(bits=4, chunk=64)
    state = TwoPhaseState()
    average_([("a", _grad(rank, 4099, 0), config)], state, wave_bytes=100)
    before = (state.worker["a"].clone(), state.owner["a"].clone())
    bad = _grad(rank, 4099, 1)
    if rank == world_size - 1:
        bad[4000] = float("inf")
    tensors = [("a", bad, config), ("b", _grad(rank, 100, 1), config)]
    average_(tensors, state, wave_bytes=100)
    out["nonfinite"] = (
        bool(torch.isnan(tensors[0][1]).all()),
        bool(torch.isfinite(tensors[1][1]).all()),
        torch.equal(state.worker["a"], before[0]) or rank != world_size - 1,
        torch.equal(state.owner["a"], before[1]),
    )
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_waves_change_no_bit_of_the_exchange(world_size: int) -> None:
    """Many waves (rows of every slice at a time, each with its own collectives) give the
    bits of one: the averages, both residuals and the bytes sent."""
    results = shared_ranks(world_size).run(_wave_cases, timeout_s=180)
    for rank, got in enumerate(results):
        for spec, (one, many) in ((k, v) for k, v in got.items() if k != "nonfinite"):
            for a, b in zip(one[0], many[0], strict=True):
                for x, y in zip(a, b, strict=True):
                    assert torch.equal(x, y), (rank, spec)
            for kind in ("worker", "owner"):
                assert one[1][kind].keys() == many[1][kind].keys(), (rank, spec)
                for name, residual in one[1][kind].items():
                    assert torch.equal(residual, many[1][kind][name]), (rank, spec, kind, name)
            assert one[2] == many[2], (rank, spec)
        assert got["nonfinite"] == (True, True, True, True), rank


def test_a_failed_wave_fails_the_exchange() -> None:
    """Several waves' collectives become one future that fails with any of them (a peer gone
    mid-exchange raises through DDP's backward, not a silently applied buffer)."""
    from superneurons.ddp.twophase import _all

    class Work:
        def __init__(self, future: torch.futures.Future[Any]) -> None:
            self.future = future

        def get_future(self) -> torch.futures.Future[Any]:
            return self.future

    ok, bad = torch.futures.Future(), torch.futures.Future()  # type: ignore[var-annotated]
    both = _all([Work(ok), Work(bad)])
    ok.set_result(None)
    bad.set_exception(RuntimeError("a peer is gone"))
    with pytest.raises(RuntimeError, match="a peer is gone"):
        both.wait()
