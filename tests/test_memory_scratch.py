"""A CPU op's scratch: the most its own allocations held above what they hold when it returns
(its outputs), allocations and frees matched by address."""

from __future__ import annotations

import torch

from superneurons.memory.profiling.workspace import op_scratch, scratch_recorder
from superneurons.memory.tracker import MARKER

FLOAT_BYTES = 4


def _marked(index: int) -> torch.autograd.profiler.record_function:
    return torch.autograd.profiler.record_function(f"{MARKER}{index}")


def test_scratch_is_the_ops_own_allocations_beyond_its_output() -> None:
    with scratch_recorder(True) as recording:
        with _marked(1):
            scratch = torch.empty(3000)
            del scratch
            out = torch.empty(500)
        with _marked(2):  # its outputs only: no scratch
            kept = torch.empty(700)
    assert op_scratch(recording) == {1: (3000 - 500) * FLOAT_BYTES}
    del out, kept


def test_a_free_of_memory_the_op_did_not_allocate_is_not_its_scratch() -> None:
    """Python's garbage collector can free older tensors inside an op's range: counting that
    drop as scratch made the profile depend on the process's history."""
    with scratch_recorder(True) as recording:
        older = torch.empty(5000)
        with _marked(1):
            scratch = torch.empty(1000)
            del scratch
            del older  # freed inside the range, allocated before it
            out = torch.empty(200)
    assert op_scratch(recording) == {1: (1000 - 200) * FLOAT_BYTES}
    del out


def test_no_recording_no_scratch() -> None:
    assert op_scratch(None) == {}
