"""θ schedules: how much of the spectrum (or of the gradient, for top-k) to drop, per step.

Wang et al., HPDC 2020 (arXiv 1811.08596): θ is the fraction of frequency coefficients dropped;
a *diminishing* θ guarantees convergence, and lowering θ recovers accuracy when training
degrades. Three policies, all frozen dataclasses:

* :class:`ConstantTheta` — ``theta(step)`` is constant;
* :class:`DiminishingTheta` — from ``start`` down to ``floor`` over ``steps`` steps, as a
  staircase (``shape="step"``, ``drops`` equal drops) or a half cosine (``shape="cosine"``);
  monotone non-increasing and exactly ``floor`` from ``steps`` on;
* :class:`ErrorBudgetTheta` — data-driven: ``choose(grad, codec)`` returns the largest θ on a
  fixed grid whose sparsification error ``||g - g_kept|| / ||g||`` is at most
  ``target_rel_error``. For FFT codecs the error follows from the sorted spectrum energy by
  Parseval (dropping coefficients of energy E leaves relative error sqrt(E / E_total)); for
  top-k from the sorted squared elements. Quantization error (``bits``) is not included.

NOTE: ranks see different gradients, so ``choose`` may differ per rank; payload sizes must be
equal for the all-gather, so the DDP hook all-reduces the chosen θ with MIN (the least
aggressive θ keeps every rank within its budget).

:func:`with_theta` applies a θ to a codec (``theta`` field for fft; ``ratio = 1 - θ`` for
top-k). :class:`ScheduleState` is the step counter with ``state_dict``.

Two wrappers the DDP hook consumes (compose them, e.g. ``ErrorFeedback(Warmup(fft, steps=100))``):
:class:`Warmup` averages densely (plain fp32 all-reduce) for the first ``steps`` steps — the
dense warm-up of DGC (Lin et al., ICLR'18) — and :class:`Scheduled` drives ``inner``'s θ by a
schedule.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from superneurons.codecs.canonical import Canonical
from superneurons.codecs.codec import Codec, Specced, check_gradient
from superneurons.codecs.sparse.fft import FFTCodec, kept_count, spectrum_layout
from superneurons.codecs.sparse.topk import TopKCodec
from superneurons.errors import ConfigError

__all__ = [
    "ConstantTheta",
    "DiminishingTheta",
    "ErrorBudgetTheta",
    "ScheduleState",
    "Scheduled",
    "ThetaSchedule",
    "Warmup",
    "sparsification_error",
    "with_theta",
]

SHAPES = ("step", "cosine")
DEFAULT_GRID: tuple[float, ...] = (0.99, 0.98, 0.95, 0.9, 0.8, 0.7, 0.5, 0.3, 0.0)


def _check_theta(theta: object, what: str) -> float:
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ConfigError(f"{what} must be a number in [0, 1), got {theta!r}")
    if not 0.0 <= float(theta) < 1.0:
        raise ConfigError(
            f"{what} is the fraction of coefficients dropped and must be in [0, 1), got {theta}"
        )
    return float(theta)


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"schedule step must be an integer >= 0, got {step!r}")


@dataclass(frozen=True)
class ConstantTheta:
    """The same θ at every step: ``ConstantTheta(0.9).theta(step) == 0.9``.

    NOTE: the field is ``value``, not ``theta``: every schedule's verb is ``theta(step)``.
    """

    value: float = 0.9

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", _check_theta(self.value, "ConstantTheta.value"))

    def theta(self, step: int) -> float:
        _check_step(step)
        return self.value


@dataclass(frozen=True)
class DiminishingTheta:
    """θ from ``start`` down to ``floor`` over ``steps`` steps (HPDC'20: diminishing θ).

    ``shape="step"``: ``drops`` equal drops, the last one at ``steps``; ``shape="cosine"``:
    ``floor + (start - floor) * (1 + cos(pi * t / steps)) / 2``. Both are monotone
    non-increasing and equal ``floor`` for every ``step >= steps``.
    """

    start: float = 0.99
    floor: float = 0.9
    steps: int = 1000
    shape: str = "step"
    drops: int = 4

    def __post_init__(self) -> None:
        start = _check_theta(self.start, "DiminishingTheta.start")
        floor = _check_theta(self.floor, "DiminishingTheta.floor")
        if floor > start:
            raise ConfigError(
                f"DiminishingTheta: floor ({floor}) must be <= start ({start}); θ diminishes"
            )
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ConfigError(
                f"DiminishingTheta: steps must be an integer >= 1, got {self.steps!r}"
            )
        if self.shape not in SHAPES:
            raise ConfigError(
                f"DiminishingTheta: shape must be one of {SHAPES}, got {self.shape!r}"
            )
        if isinstance(self.drops, bool) or not isinstance(self.drops, int) or self.drops < 1:
            raise ConfigError(
                f"DiminishingTheta: drops must be an integer >= 1, got {self.drops!r}"
            )
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "floor", floor)

    def theta(self, step: int) -> float:
        _check_step(step)
        t = min(step, self.steps)
        if t == self.steps:
            return self.floor
        if self.shape == "step":
            done = (t * self.drops) // self.steps  # drops taken so far, 0..drops-1
            return self.start - (self.start - self.floor) * done / self.drops
        return self.floor + (self.start - self.floor) * 0.5 * (
            1.0 + math.cos(math.pi * t / self.steps)
        )


@dataclass(frozen=True)
class ErrorBudgetTheta:
    """The largest θ on ``grid`` whose sparsification error is at most ``target_rel_error``.

    Falls back to the smallest θ on the grid when none meets the target, and for a non-finite
    gradient (that step is skipped anyway).
    """

    target_rel_error: float = 0.3
    grid: tuple[float, ...] = DEFAULT_GRID

    def __post_init__(self) -> None:
        target = self.target_rel_error
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target <= 1:
            raise ConfigError(
                f"ErrorBudgetTheta: target_rel_error (||g - g_kept|| / ||g||) must be in (0, 1], "
                f"got {target!r}"
            )
        grid = tuple(self.grid)
        if not grid:
            raise ConfigError("ErrorBudgetTheta: grid needs at least one θ")
        checked = tuple(sorted({_check_theta(t, "ErrorBudgetTheta.grid θ") for t in grid}))
        object.__setattr__(self, "target_rel_error", float(target))
        object.__setattr__(self, "grid", checked)

    def choose(self, grad: torch.Tensor, codec: Codec) -> float:
        """θ for this gradient (a host sync: returns a float)."""
        errors = sparsification_error(grad, codec, self.grid)
        for theta, error in zip(reversed(self.grid), reversed(errors), strict=True):
            if error <= self.target_rel_error:
                return theta
        return self.grid[0]


def sparsification_error(
    grad: torch.Tensor, codec: Codec, thetas: tuple[float, ...]
) -> list[float]:
    """Relative error ``||g - g_kept|| / ||g||`` of dropping each θ with ``codec``'s selection
    (before quantization); NaN for a non-finite gradient, 0 for a zero gradient."""
    flat = check_gradient(grad, codec_name="ErrorBudgetTheta").to(torch.float32)
    energy, dropped = _energies(flat, codec, thetas)  # (n,) sorted ascending, counts per θ
    if not bool(torch.isfinite(energy).all()):
        return [math.nan] * len(thetas)
    cumulative = torch.cumsum(energy.to(torch.float64), 0)
    total = float(cumulative[-1])
    out = []
    for count in dropped:
        lost = float(cumulative[count - 1]) if count > 0 else 0.0
        out.append(math.sqrt(lost / total) if total > 0 else 0.0)
    return out


def _energies(
    flat: torch.Tensor, codec: Codec, thetas: tuple[float, ...]
) -> tuple[torch.Tensor, list[int]]:
    """Per-coefficient energies sorted ascending and, per θ, how many the codec drops."""
    numel = flat.numel()
    if isinstance(codec, TopKCodec):
        energy = flat.square().sort().values  # (n,)
        return energy, [numel - TopKCodec(ratio=1.0 - t).kept(numel) for t in thetas]
    if isinstance(codec, FFTCodec):
        # Mirror FFTCodec's selection: chunked rFFT, multiplicity-weighted power w * |X|**2,
        # the T - kept_count(T, θ) smallest bins over all chunks dropped. By Parseval the
        # weighted powers sum to L * ||g||**2, so energy shares are error shares.
        length, chunks = spectrum_layout(numel, codec.chunk)
        padded = torch.nn.functional.pad(flat.cpu(), (0, chunks * length - numel))
        spectrum = torch.fft.rfft(padded.view(chunks, length))  # (C, L // 2 + 1)
        power = spectrum.real.square() + spectrum.imag.square()  # (C, B)
        power[:, 1 : (length + 1) // 2] *= 2.0  # bins with a conjugate twin count twice
        universe = power.numel()
        energy = power.reshape(-1).sort().values  # (T,)
        return energy, [universe - kept_count(universe, t) for t in thetas]
    raise ConfigError(
        f"ErrorBudgetTheta: codec {codec.spec!r} has no θ; it applies to fft and topk codecs"
    )


def with_theta(codec: Codec, theta: float) -> Codec:
    """``codec`` with this θ: ``theta=θ`` for codecs with a theta field (fft), ``ratio=1-θ`` for
    top-k. Raises ConfigError for codecs without a sparsity knob."""
    theta = _check_theta(theta, "θ")
    if dataclasses.is_dataclass(codec) and "theta" in {f.name for f in dataclasses.fields(codec)}:
        return dataclasses.replace(codec, theta=theta)  # type: ignore[type-var]
    if isinstance(codec, TopKCodec):
        return dataclasses.replace(codec, ratio=1.0 - theta)
    raise ConfigError(
        f"codec {codec.spec!r} has no θ to schedule; θ schedules apply to fft (theta) and "
        "topk (ratio = 1 - θ)"
    )


@dataclass
class ScheduleState:
    """The step counter a schedule is evaluated at (explicit, checkpointable)."""

    step: int = 0

    def advance(self) -> int:
        self.step += 1
        return self.step

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        step = state.get("step") if isinstance(state, Mapping) else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(
                f"ScheduleState.load_state_dict: need {{'step': int >= 0}}, got {state!r}"
            )
        self.step = step


ThetaSchedule = ConstantTheta | DiminishingTheta | ErrorBudgetTheta


@dataclass(frozen=True)
class Warmup(Canonical):
    """Plain fp32 averaging for the first ``steps`` steps, then ``inner``.

    Spec form ``warmup(steps=N,INNER)``, e.g. ``warmup(steps=100,topk:ratio=0.01)`` (the
    wrapper's own options come first, the wrapped spec last).
    """

    inner: Specced
    steps: int = 0
    NAME: ClassVar[str] = "warmup"

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise ConfigError(f"warmup: steps must be an integer >= 0, got {self.steps!r}")


@dataclass(frozen=True)
class Scheduled:
    """``inner`` (fft or topk, possibly wrapped) with its θ set per step by ``schedule``.

    ``ConstantTheta``/``DiminishingTheta`` give ``theta(step)``; ``ErrorBudgetTheta`` chooses
    per gradient and the hook agrees the choice across ranks (all-reduce MIN). Not part of
    the CLI's spec grammar: its string form names the schedule by ``repr``.
    """

    inner: Specced
    schedule: ThetaSchedule
    NAME: ClassVar[str] = "scheduled"

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, (ConstantTheta, DiminishingTheta, ErrorBudgetTheta)):
            raise ConfigError(
                f"Scheduled: schedule must be ConstantTheta, DiminishingTheta or "
                f"ErrorBudgetTheta, got {self.schedule!r}"
            )

    @property
    def spec(self) -> str:
        return f"{self.NAME}({self.inner.spec},{self.schedule!r})"

    def __str__(self) -> str:
        return self.spec
