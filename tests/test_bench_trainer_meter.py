"""Per-step live-storage peaks of a ``Trainer`` (:class:`TrainerStepPeaks`): what is resident
at a step's start plus what the step allocates, counted exactly; misuse is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from superneurons.bench.memory.trainer_meter import TrainerStepPeaks

pytest.importorskip("transformers")


def _trainer() -> SimpleNamespace:
    model = torch.nn.Linear(10, 10)  # 440 bytes of parameters
    return SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_step_counts_the_resident_bytes_and_what_it_allocates() -> None:
    meter = TrainerStepPeaks(_trainer(), record_timeline=True)
    meter.begin()
    scratch = torch.empty(1000)  # 4,000 bytes, freed before the step ends
    del scratch
    meter.end()
    assert meter.peaks == [440 + 4000]
    assert max(meter.timeline_bytes) == 440 + 4000


def test_end_without_begin_and_a_missing_optimizer_are_refused() -> None:
    meter = TrainerStepPeaks(_trainer())
    with pytest.raises(RuntimeError, match="without begin"):
        meter.end()
    bare = TrainerStepPeaks(SimpleNamespace(model=torch.nn.Linear(2, 2), optimizer=None))
    with pytest.raises(RuntimeError, match="no optimizer yet"):
        bare.begin()
