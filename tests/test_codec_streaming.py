"""The codecs' one-pass CPU paths: the same bits as the plain compositions they replace, no
full-size buffer per step after warm-up, and work that grows linearly with the gradient.

Properties, not timings: allocations are counted (a dispatch mode sees every tensor torch
allocates; ``tracemalloc`` sees numpy's), and "linear" is the bytes every torch operation
reads and writes per gradient value, at 1M and at 30M values."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from superneurons.codecs import twophase_stages as stages
from superneurons.codecs.codec import decode_mean_into, subtract_decode
from superneurons.codecs.coding import sparsecode, streaming
from superneurons.codecs.coding.bitpack import pack_bits, pack_rows_, unpack_bits, unpack_rows
from superneurons.codecs.sparse import blocks
from superneurons.compress import TwoPhase, parse_spec

# every codec of the payload-identity benchmark's list, in its short form
SPECS = [
    "fft", "fft:index=bitmap", "fft:bits=32", "fft:chunk=0", "fft:chunk=300", "fft:theta=0.99",
    "adaptive", "ctopk", "ctopk:bits=32", "ctopk:select=exact", "topk",
    "topk:ratio=0.1,select=sampled", "identity", "fp16", "bf16", "rangefloat", "qsgd",
    "terngrad", "signsgd",
]  # fmt: skip


class _Work(TorchDispatchMode):
    """Every tensor torch allocates (bytes of each new storage) and the bytes each operation
    (views aside) takes and gives: an upper bound of what it reads and writes."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated: list[int] = []
        self.touched = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        held = {t.untyped_storage().data_ptr() for t in ins}
        for tensor in outs:
            if tensor.untyped_storage().data_ptr() not in held:
                self.allocated.append(tensor.untyped_storage().nbytes())
        if not func.is_view:  # a view moves no data (and would count its base's size)
            self.touched += sum(t.numel() * t.element_size() for t in ins + outs)
        return out


def _step(spec: str, numel: int) -> Callable[[], None]:
    """One rank's codec work of a DDP step on a ``numel`` gradient (P = 2)."""
    gen = torch.Generator().manual_seed(numel % 1000)
    grad = torch.randn(numel, generator=gen)
    if spec.startswith("twophase"):
        config = TwoPhase(bits=int(spec.split("=")[1]))
        layout = config.layout(numel, 2)
        rows = torch.zeros(layout.padded_numel)
        rows[:numel] = grad
        rows2 = rows.view(-1, layout.cols)
        residual, error, out = (torch.zeros_like(rows2) for _ in range(3))
        owner_residual, owner_error = (torch.zeros(layout.rows, layout.cols) for _ in "ab")
        message = torch.zeros(2, layout.slice_bytes, dtype=torch.uint8)
        owned = torch.zeros(1, layout.slice_bytes, dtype=torch.uint8)
        scratch = stages.StageScratch.make(
            layout, lambda _, n, d: torch.empty(n, dtype=d), torch.device("cpu")
        )

        def two_phase() -> None:
            stages.worker_encode(
                rows2, message, layout, config, scratch, residual=residual, error=error
            )
            stages.owner_reduce(
                message, owned, layout, config, scratch,
                residual=owner_residual, error=owner_error,
            )  # fmt: skip
            stages.decode_slices(message, out, layout, config, scratch)

        return two_phase
    codec = parse_spec(spec)
    slab, out = torch.zeros_like(grad), torch.empty_like(grad)

    def gathered() -> None:
        payload = codec.encode(grad)
        subtract_decode(codec, payload, torch.add(grad, 0.5, out=slab))
        decode_mean_into(codec, [payload, payload], out, 2)

    return gathered


@pytest.mark.parametrize("spec", SPECS)
def test_decodes_into_a_buffer_equal_the_plain_composition(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # small blocks: the blocked decodes and scatters cross many block boundaries
    monkeypatch.setattr(sparsecode, "BLOCK_NUMEL", 1 << 12)
    monkeypatch.setattr(blocks, "_BLOCK_VALUES", 1 << 11)
    codec = parse_spec(spec)
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(300_007, generator=gen)
    grad[1000:1600] = 0.0  # a run of zeros (ties) and of -0
    grad[2000:2100] = -0.0
    payloads = [codec.encode(grad * s, generator=torch.Generator().manual_seed(1)) for s in (1, -2)]
    want = torch.div(codec.decode_sum(payloads), 2)
    got = decode_mean_into(codec, payloads, torch.full_like(grad, 7.0), 2)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    target = grad + 0.25
    want_residual = torch.sub(target, codec.decode(payloads[0]))
    got_residual = subtract_decode(codec, payloads[0], target.clone())
    assert torch.equal(got_residual.view(torch.int32), want_residual.view(torch.int32))


@pytest.mark.parametrize("score", ["square", "abs"])
def test_one_pass_selection_keeps_the_two_pass_set(score: str) -> None:
    gen = torch.Generator().manual_seed(8)
    flat = torch.randn(700_001, generator=gen) * torch.rand(700_001, generator=gen).add(0.1)
    values = flat * flat if score == "square" else flat.abs()
    for count in (7_000, 70_000):
        chosen = streaming.select_streaming(flat, count, score=score)
        assert chosen is not None
        indices, finite = chosen
        two_pass = sparsecode.select_indices(
            values, count, "sampled", period=streaming.SPATIAL_PERIOD
        )
        assert torch.equal(indices, two_pass) and bool(finite)
    flat[5] = float("nan")
    chosen = streaming.select_streaming(flat, 7_000, score=score)
    assert chosen is None or not bool(chosen[1])  # a NaN is never reported finite


def test_numpy_float_to_uint8_truncates_as_torch_does() -> None:
    grid = torch.arange(-2 * 2**12, 260 * 2**12, dtype=torch.float64).div(2**12).float()
    want = torch.empty(grid.numel(), dtype=torch.uint8).copy_(grid)
    got = np.empty(grid.numel(), dtype=np.uint8)
    np.copyto(got, grid.numpy(), casting="unsafe")
    assert torch.equal(torch.from_numpy(got), want)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_rows_pack_and_unpack_as_pack_bits_does(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (3, 1024), generator=gen).to(torch.uint8)
    width = 1024 * bits // 8
    want = torch.stack([pack_bits(row, bits) for row in codes])
    message = torch.zeros(3, width + 8, dtype=torch.uint8)  # rows written into a strided view
    pack_rows_(codes.clone(), bits, out=message[:, 4 : 4 + width])
    assert torch.equal(message[:, 4 : 4 + width], want)
    back = torch.empty(3, 1024, dtype=torch.uint8)
    unpack_rows(message[:, 4 : 4 + width], bits, out=back)
    assert torch.equal(back, codes)
    assert torch.equal(unpack_bits(want[1], bits, 1024).to(torch.uint8), codes[1])


@pytest.mark.parametrize("spec", ["ctopk", "topk", "fft", "twophase:bits=4", "twophase:bits=1"])
def test_no_full_size_buffer_per_step_after_warm_up(spec: str) -> None:
    numel = 1 << 21
    step = _step(spec, numel)
    step()
    step()  # warm-up: kept buffers, plans, caches
    with _Work() as work:
        step()
    tracemalloc.start()  # apart: entering the dispatch mode the first time imports modules
    step()
    numpy_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # a full-size buffer would be 4 bytes per value (fp32) or 1 (a mask): none reaches 1
    assert max(work.allocated, default=0) < numel, sorted(work.allocated)[-3:]
    # numpy: the candidates and block buffers, less than one fp32 gradient in all
    assert numpy_peak < 4 * numel


@pytest.mark.parametrize("spec", ["ctopk", "fft", "twophase:bits=4"])
def test_work_per_value_does_not_grow_from_1m_to_30m_values(spec: str) -> None:
    per_value = []
    for numel in (1_000_000, 30_000_000):
        step = _step(spec, numel)
        step()
        with _Work() as work:
            step()
        per_value.append(work.touched / numel)
    assert per_value[1] <= 1.2 * per_value[0], per_value


@pytest.mark.parametrize("numel", [513, 1 << 20])
@pytest.mark.parametrize("spec", ["ctopk", "ctopk:bits=32", "ctopk:select=exact,index=bitmap"])
def test_the_payload_records_exactly_whether_every_value_was_finite(spec: str, numel: int) -> None:
    """The hook reads finiteness from a ``ctopk`` message instead of a pass over the values:
    the flag must equal ``all_finite`` of the encoded gradient, also where the bad value is
    not kept and where a finite value's square overflows."""
    from superneurons.codecs.coding.finite import all_finite

    codec = parse_spec(spec)
    gen = torch.Generator().manual_seed(numel)
    cases = {"finite": torch.randn(numel, generator=gen)}
    for name, bad in [("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf"))]:
        cases[name] = cases["finite"].clone()
        cases[name][numel // 3] = bad
    cases["square overflows"] = cases["finite"].clone()
    cases["square overflows"][7] = 3e38
    cases["tiny among huge"] = cases["finite"] * 1e30
    for name, vector in cases.items():
        payload = codec.encode(vector)
        assert codec.payload_finite(payload) is all_finite(vector), name
