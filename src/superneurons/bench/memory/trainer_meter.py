"""Each optimizer step's peak of live storage bytes in a Hugging Face ``Trainer`` (TRL's
``SFTTrainer`` included), by the tracker the memory profile uses: what a plan's budget bounds.

Add :attr:`TrainerStepPeaks.callback` to the trainer's callbacks; after training, ``peaks``
holds one figure per step. A step counts the parameters, buffers, the gradients alive when it
begins, the optimizer's state and everything the step allocates; the batch, made by the loader
before the step begins, is not counted.
"""

from __future__ import annotations

from typing import Any

import torch

from superneurons.memory.offload.handover import inner_optimizer
from superneurons.memory.tracker import LiveStorageTracker

__all__ = ["TrainerStepPeaks"]


class TrainerStepPeaks:
    """Per-step live-storage peaks of ``trainer`` (a ``transformers.Trainer``).

    Attributes:
        callback: the ``TrainerCallback`` to pass in ``callbacks=[...]``.
        peaks: bytes, one per finished optimizer step.
        timeline_bytes: with ``record_timeline``, the last step's live bytes after each op.
    """

    def __init__(self, trainer: Any, *, record_timeline: bool = False) -> None:
        from transformers import TrainerCallback

        meter = self

        class _Callback(TrainerCallback):  # type: ignore[misc]
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                meter.begin()

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                meter.end()

        self.trainer = trainer
        self.callback = _Callback()
        self.peaks: list[int] = []
        self.timeline_bytes: list[int] = []
        self._record_timeline = record_timeline
        self._tracker: LiveStorageTracker | None = None

    def begin(self) -> None:
        """Start counting: what is resident now is registered, the tracker entered."""
        model = self.trainer.model
        optimizer = inner_optimizer(self.trainer.optimizer)
        if optimizer is None:
            raise RuntimeError("the trainer has no optimizer yet: begin() runs at a step's start")
        tracker = LiveStorageTracker(record_timeline=self._record_timeline)
        tracker.register([*model.parameters(), *model.buffers()])
        tracker.register([p.grad for p in model.parameters() if p.grad is not None])
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        tracker.register(state)
        self._tracker = tracker.__enter__()

    def end(self) -> None:
        """Stop counting and record the step's peak (and timeline)."""
        if self._tracker is None:
            raise RuntimeError("end() without begin(): the step was not being counted")
        self._tracker.__exit__(None, None, None)
        self.peaks.append(int(self._tracker.peak_bytes))
        if self._record_timeline:
            self.timeline_bytes = [int(b) for b in self._tracker.timeline_bytes]
        self._tracker = None
