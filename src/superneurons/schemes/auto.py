"""``auto``: choose each bucket's codec from a measured network and backward timeline.

Model-aware synchronisation (Poseidon ATC'17, Parallax EuroSys'19; Espresso EuroSys'23 for the
per-tensor choice): fit the collectives' cost ``T = α + β·bytes`` on the real process group,
measure each candidate codec's encode/decode time on this device, observe when each bucket
becomes ready in backward during ``observe_steps`` dense steps, then choose per bucket the codec
with the least predicted *exposed* step time (pure functions in :mod:`superneurons.strategy`).
This module is the hook's side: :class:`Auto` is the frozen config (spec ``auto:...``) and
:class:`AutoController` carries the decision out (see :mod:`superneurons.ddp.autorun`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from superneurons.codecs.canonical import Canonical
from superneurons.errors import ConfigError

__all__ = ["GENERAL_BUDGET", "Auto"]

# The one-shot error budgets, calibrated on the benchmark ResNet (Fashion-MNIST, 2
# ranks, 100 SGD steps, error feedback, 2-3 seeds; benchmarks/results/network/auto/
# error_budget.json): qsgd (one-shot 0.58) tracked dense (training loss 0.02-0.05 below it),
# top-k 10% (0.68) did not (+0.35 to +0.67 loss, 9-16 test points), so the general budget is
# 0.6. PowerSGD rank 4 (0.74) ended 0.08-0.20 above dense's loss and 6.8 test points below it on
# average (PyTorch's hook alike), rank 1 (0.86) far behind: PowerSGD gets the general budget
# by default (``max_rel_error_lowrank=None``); ``auto:max_rel_error_lowrank=0.8`` admits rank 4
# where that cost is acceptable. At 400 steps (error_budget_400.json, seeds 0 and 1)
# rank 4's gap narrowed but stayed above 0.03 in loss: +0.03 and +0.06 (last 100 steps +0.05
# and +0.06; test accuracy +1.95 and -1.45 points), so the default stays None.
GENERAL_BUDGET = 0.6


@dataclass(frozen=True)
class Auto(Canonical):
    """Per-bucket choice among dense and the candidate codecs, re-decided on drift.

    Args:
        observe_steps: dense steps that time the buckets before the first decision (the
            first step is not timed: DDP rebuilds its buckets after it).
        max_rel_error: candidates whose one-shot ``‖ĝ−g‖/‖g‖`` exceeds this are not chosen.
        max_rel_error_lowrank: the budget for PowerSGD candidates; None (the default): the
            same as ``max_rel_error`` (see :func:`superneurons.strategy.select`; both defaults
            are calibrated by ``benchmarks/auto_error_budget.py``,
            ``benchmarks/results/network/auto``).
        drift: re-decide when the measured step time differs from the prediction by more than
            this fraction ...
        drift_steps: ... for this many consecutive steps.
    """

    observe_steps: int = 3
    max_rel_error: float = GENERAL_BUDGET
    max_rel_error_lowrank: float | None = None
    drift: float = 0.5
    drift_steps: int = 5
    NAME: ClassVar[str] = "auto"
    SPEC_HINT: ClassVar[str] = (
        "link, latency and margin are auto's options with --optimizer adam or adamw"
    )

    def __post_init__(self) -> None:
        for name in ("observe_steps", "drift_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"auto: {name} must be an integer >= 1, got {value!r}")
        for name in ("max_rel_error", "max_rel_error_lowrank"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ConfigError(f"auto: {name} must be in (0, 1], got {value}")
        if not self.drift > 0:
            raise ConfigError(f"auto: drift must be > 0, got {self.drift}")

    @property
    def summable(self) -> bool:
        return False
