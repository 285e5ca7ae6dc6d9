"""The CPU allocator meter (:func:`~superneurons.bench.memory.meter.allocator_timeline_bytes`)
counts a step's bytes exactly, whatever profiler runs came before it in the process.

The c10 CPU allocator sizes a free from a table it fills only while a profiler runs: a block
allocated under one profiler and freed outside it leaves its size behind, and a smaller block
allocated later at that address outside a profiler is reported freed with the old size. Summing
the reported sizes then under-counts the step (a test suite's earlier tests leave such entries,
so a peak measured late in the suite read 43% of the true one). The meter pairs each free with
the allocation of the same address it saw (:func:`events_timeline_bytes`); whether the C library
hands a freed address back depends on the heap's history, so the pairing is proved on events
written out here, and the whole meter on a step whose bytes are known.
"""

from __future__ import annotations

import torch

from superneurons.bench.memory.meter import allocator_timeline_bytes, events_timeline_bytes

MIB = 1 << 20


def _one_mebibyte_step() -> None:
    scratch = torch.ones(MIB // 4)  # float32: 1 MiB, freed before the step returns
    del scratch


def test_a_step_reads_its_own_bytes_on_top_of_the_resident_ones() -> None:
    resident = torch.zeros(1000)  # 4,000 bytes
    timeline = allocator_timeline_bytes(_one_mebibyte_step, resident=lambda: [resident])
    assert timeline[0] == 4000 and max(timeline) == 4000 + MIB and timeline[-1] == 4000


def test_a_free_counts_the_size_of_the_allocation_seen_at_its_address() -> None:
    window = (100, 200)  # the measured step; before it, the profiler's first step
    events = [
        (50, 0xA000, 3000),  # the first step allocates what the measured step frees
        (110, 0xB000, MIB),  # the measured step's scratch...
        (120, 0xB000, -MIB),  # ...freed
        (130, 0xA000, -3000),  # the first step's block, freed: subtracted
        # a block allocated before the profiler, at an address an earlier profiler run saw
        # with 40,000 bytes: the allocator reports the stale size; it is not subtracted
        (140, 0xC000, -40_000),
        (150, 0xD000, 500),
        (250, 0xD000, -500),  # after the window: not in the timeline
    ]
    timeline = events_timeline_bytes(events, base_bytes=7000, window_ns=window)
    assert timeline == [7000, 7000 + MIB, 7000, 4000, 4500]


def test_an_address_reused_inside_the_window_is_paired_with_its_latest_allocation() -> None:
    events = [(10, 0xA000, 100), (20, 0xA000, -100), (30, 0xA000, 60), (40, 0xA000, -60)]
    assert events_timeline_bytes(events, base_bytes=0, window_ns=(0, 50)) == [0, 100, 0, 60, 0]
