"""The CPU allocator meter (:func:`~superneurons.bench.memory.meter.allocator_timeline_bytes`)
counts a step's bytes exactly, whatever profiler runs came before it in the process.

The c10 CPU allocator sizes a free from a table it fills only while a profiler runs: a block
allocated under one profiler and freed outside it leaves its size behind, and a smaller block
allocated later at that address outside a profiler is reported freed with the old size. Summing
the reported sizes then under-counts the step (a test suite's earlier tests leave such entries,
so a peak measured late in the suite read 43% of the true one). The meter pairs each free with
the allocation of the same address it saw.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from superneurons.bench.memory.meter import allocator_peak_bytes, allocator_timeline_bytes

MIB = 1 << 20


def _one_mebibyte_step() -> None:
    scratch = torch.ones(MIB // 4)  # float32: 1 MiB, freed before the step returns
    del scratch


def test_a_step_reads_its_own_bytes_on_top_of_the_resident_ones() -> None:
    resident = torch.zeros(1000)  # 4,000 bytes
    timeline = allocator_timeline_bytes(_one_mebibyte_step, resident=lambda: [resident])
    assert timeline[0] == 4000 and max(timeline) == 4000 + MIB and timeline[-1] == 4000


def test_stale_sizes_left_by_an_earlier_profiler_are_not_subtracted() -> None:
    # blocks allocated under a profiler, freed outside it: their sizes stay in the table
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        large = [torch.empty(40_000, dtype=torch.uint8) for _ in range(200)]
    addresses = {t.data_ptr() for t in large}
    del large
    # smaller blocks allocated outside a profiler, some at those addresses
    small = [torch.empty(10_000, dtype=torch.uint8) for _ in range(200)]
    reused = sum(t.data_ptr() in addresses for t in small)
    assert reused > 0  # the allocator handed back freed addresses (glibc's bins do)
    calls = []

    def step() -> None:  # the measured (second) call frees the small blocks
        calls.append(1)
        if len(calls) == 2:
            small.clear()
        _one_mebibyte_step()

    # the stale sizes would subtract reused * 40,000 bytes: here nothing is subtracted for
    # blocks allocated before the profiler, so the peak is the step's own mebibyte
    assert allocator_peak_bytes(step, resident=list) == MIB
