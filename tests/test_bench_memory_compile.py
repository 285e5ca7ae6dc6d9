"""``bench memory``'s CPU meter sees what ``torch.compile``'s generated code allocates.

Inductor's CPU kernels get their buffers from the c10 allocator without going through the
dispatcher, where the live-storage count looks; the meter reads the allocator's own events
(:func:`~superneurons.bench.memory.meter.allocator_peak_bytes`), so the compile anchor of
``bench memory`` is measured in the same view as our plans and the other anchors.
"""

from __future__ import annotations

import pytest
import torch

from superneurons.bench.memory.meter import allocator_peak_bytes
from superneurons.bench.memory.run import MemoryBenchConfig, run_memory_bench


@pytest.mark.slow  # inductor generates and compiles C++ (tens of seconds)
def test_the_allocator_meter_sees_inductors_buffers() -> None:
    x = torch.randn(128, 128)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.exp()  # inductor writes it into a buffer of its own: the matmul reads it
        return (y @ y.T).sum()

    compiled = torch.compile(f)
    torch.testing.assert_close(compiled(x), f(x))
    peak = allocator_peak_bytes(lambda: compiled(x), resident=lambda: [x])
    assert peak >= 3 * x.nbytes  # x, exp(x) and the matmul's output, all alive at once
    torch._dynamo.reset()


def test_the_cpu_compile_anchor_keeps_the_allocators_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """The anchor's CPU record is the allocator's peak, in the same view as eager's (dynamo's
    ``eager`` backend stands in for inductor here: the record, not the code generation, is
    under test; the test above proves the meter sees inductor's buffers)."""
    compile_with = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model: compile_with(model, backend="eager"))
    config = MemoryBenchConfig(
        model="gpt", tiny=True, methods=("eager", "compile"), batch_size=2, block_size=32,
        steps=1, budgets=(0.9,), compile_budgets=(1.0,),
    )  # fmt: skip
    records = run_memory_bench(config)
    eager = next(r for r in records if r["method"] == "eager")
    (row,) = [r for r in records if r["method"] == "compile"]
    assert "skipped" not in row, row
    assert row["tracked_peak_bytes"] is None  # the live count cannot see inductor: dropped
    # the same eager-equivalent graph, the same meter: the same peak
    assert row["peak_bytes"] == eager["peak_bytes"]
    assert row["peak_fraction"] == 1.0
