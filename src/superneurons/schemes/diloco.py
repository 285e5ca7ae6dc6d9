"""What ``train --sync`` names: how often ranks synchronise, and DiLoCo's outer step.

Productions of the one grammar (:func:`superneurons.schemes.grammar.parse_sync`)::

    every-step                                   gradients averaged every step (through --compress)
    diloco[:steps=H,lr=F,momentum=F,nesterov=B]  DiLoCo, the outer gradient in fp32 (all-reduce)
    diloco[steps=H,...]:SPEC                     DiLoCo, the outer gradient through SPEC

DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv 2311.08105): every rank runs its own (inner) optimizer on its own shard for ``H`` steps
with no communication; then the *outer gradient* ``θ_synced − θ_local`` is averaged across ranks
and an outer SGD step with Nesterov momentum (lr 0.7, momentum 0.9 in the paper) moves the
synced parameters, from which every rank continues. Streaming DiLoCo (Douillard et al., arXiv
2501.18512) sends the outer gradient in 4 bits with no loss; here ``SPEC`` is any codec of the
grammar (``fp16``, ``qsgd:bits=4``, ``ctopk``, ...) or the two-phase compressed all-reduce
(``twophase:bits=4``: bytes per rank independent of the world size), error feedback added by
default as for ``--compress``. :class:`DiLoCo` is the configuration; the run-time is
:mod:`superneurons.localsgd`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from superneurons.codecs.canonical import Canonical
from superneurons.codecs.codec import Codec
from superneurons.codecs.feedback import ErrorFeedback
from superneurons.codecs.twophase import TwoPhase
from superneurons.errors import ConfigError

__all__ = ["DEFAULT_OUTER_LR", "DEFAULT_OUTER_MOMENTUM", "DiLoCo", "EveryStep", "Sync", "wire_of"]

# DiLoCo's outer optimizer (arXiv 2311.08105, section 3: "outer learning rate of 0.7",
# Nesterov momentum 0.9; H = 500 inner steps).
DEFAULT_OUTER_LR = 0.7
DEFAULT_OUTER_MOMENTUM = 0.9
DEFAULT_INNER_STEPS = 500


@dataclass(frozen=True)
class EveryStep(Canonical):
    """Every step: gradients (or 1-bit Adam's momentum) are averaged as ``--compress`` says."""

    NAME: ClassVar[str] = "every-step"


def wire_of(inner: Any) -> tuple[Codec | TwoPhase | None, bool]:
    """``(codec, error_feedback)`` of a DiLoCo wire spec: ``inner`` is None (fp32), a codec, or
    ``ef(codec)``. Raises ConfigError for anything else."""
    feedback = isinstance(inner, ErrorFeedback)
    base = inner.inner if feedback else inner
    if base is None and not feedback:
        return None, False
    if isinstance(base, ErrorFeedback):
        return wire_of(base)
    if not isinstance(base, Codec | TwoPhase):
        raise ConfigError(
            f"diloco: the outer gradient travels in fp32 (diloco:steps=H) or through a codec "
            f"(diloco[steps=H]:fp16, :qsgd:bits=4, :ctopk, :twophase:bits=4, or ef(...) around "
            f"one), not {inner}"
        )
    return base, feedback


@dataclass(frozen=True)
class DiLoCo(Canonical):
    """DiLoCo: ``steps`` local steps per rank, then an outer Nesterov step on the averaged
    outer gradient.

    Args:
        inner: the outer gradient's wire: None for an fp32 all-reduce, a codec (summable
            ones are all-reduced, the others all-gathered) or ``TwoPhase``, optionally inside
            ``ef(...)``.
        steps: H, the inner steps between synchronisations (500 in the paper). A window also
            ends with each epoch of ``superneurons train``.
        outer_lr: the outer learning rate (``lr=``); 1 with ``momentum=0`` is plain model
            averaging (local SGD).
        outer_momentum: the outer momentum (``momentum=``).
        nesterov: Nesterov momentum (as ``torch.optim.SGD``); ignored when momentum is 0.
    """

    inner: Any = None
    steps: int = DEFAULT_INNER_STEPS
    outer_lr: float = field(default=DEFAULT_OUTER_LR, metadata={"key": "lr"})
    outer_momentum: float = field(default=DEFAULT_OUTER_MOMENTUM, metadata={"key": "momentum"})
    nesterov: bool = True
    NAME: ClassVar[str] = "diloco"
    BRACKETS: ClassVar[bool] = True  # diloco[steps=H,...]:SPEC; no SPEC: diloco:steps=H,...

    def __post_init__(self) -> None:
        steps = self.steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(
                f"diloco: steps (H, inner steps per round) must be >= 1, got {steps!r}"
            )
        if not self.outer_lr > 0:
            raise ConfigError(
                f"diloco: lr (the outer learning rate) must be > 0, got {self.outer_lr}"
            )
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ConfigError(
                f"diloco: momentum (the outer momentum) must be in [0, 1), got {self.outer_momentum}"
            )
        if not isinstance(self.nesterov, bool):
            raise ConfigError(f"diloco: nesterov must be true or false, got {self.nesterov!r}")
        wire_of(self.inner)  # raises for a wire that cannot carry an outer gradient

    @property
    def wire(self) -> str:
        """What the outer gradient travels as: ``fp32`` or the codec spec (``ef(...)``)."""
        return "fp32" if self.inner is None else str(self.inner.spec)


Sync = EveryStep | DiLoCo
