"""θ schedules: monotone, hit their floor; the error budget is met (and is the largest θ on
the grid that meets it); with_theta maps θ onto fft and top-k."""

from __future__ import annotations

import math

import pytest
import torch

from superneurons.codecs.codec import Codec
from superneurons.compress import (
    ConstantTheta,
    DiminishingTheta,
    ErrorBudgetTheta,
    FFTCodec,
    QSGDCodec,
    ScheduleState,
    TopKCodec,
    sparsification_error,
    with_theta,
)
from superneurons.errors import ConfigError


def test_constant_theta() -> None:
    schedule = ConstantTheta(0.8)
    assert {schedule.theta(s) for s in range(0, 1000, 97)} == {0.8}
    for bad in (1.0, -0.1, math.nan, "0.5"):
        with pytest.raises(ConfigError, match=r"\[0, 1\)"):
            ConstantTheta(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="step"):
        schedule.theta(-1)


@pytest.mark.parametrize("shape", ["step", "cosine"])
def test_diminishing_theta_is_monotone_and_hits_the_floor(shape: str) -> None:
    schedule = DiminishingTheta(start=0.99, floor=0.7, steps=100, shape=shape, drops=4)
    values = [schedule.theta(s) for s in range(250)]
    assert values[0] == 0.99
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert values[100:] == [0.7] * 150
    assert all(v > 0.7 for v in values[:100])
    if shape == "step":
        assert len(set(values)) == 5  # start + 4 drops, the last one landing on the floor


@pytest.mark.parametrize(
    "kwargs",
    [
        {"start": 0.5, "floor": 0.9},
        {"start": 1.0},
        {"floor": -0.1},
        {"steps": 0},
        {"shape": "linear"},
        {"drops": 0},
    ],
)
def test_diminishing_theta_rejects_bad_config(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="DiminishingTheta"):
        DiminishingTheta(**kwargs)  # type: ignore[arg-type]


def _measured_error(codec: Codec, grad: torch.Tensor) -> float:
    decoded = codec.decode(codec.encode(grad))
    return float((decoded - grad).norm() / grad.norm())


def _smooth_gradient(numel: int) -> torch.Tensor:
    """Energy concentrated at low frequencies, as in real gradients (a random walk)."""
    gen = torch.Generator().manual_seed(0)
    walk = torch.cumsum(torch.randn(numel, generator=gen), 0) * 0.01
    return walk + torch.randn(numel, generator=gen) * 0.05


@pytest.mark.parametrize(
    "codec",
    [FFTCodec(bits=32), FFTCodec(bits=32, chunk=256), TopKCodec()],
    ids=lambda c: c.spec,
)
@pytest.mark.parametrize("target", [0.05, 0.1, 0.2])
def test_error_budget_meets_target_and_is_maximal(codec: Codec, target: float) -> None:
    """Measured with the real codec (bits=32: lossless values, so the error is sparsification
    only, up to float32 FFT rounding)."""
    grad = _smooth_gradient(3000) if isinstance(codec, FFTCodec) else torch.randn(3000)
    schedule = ErrorBudgetTheta(target_rel_error=target)
    theta = schedule.choose(grad, codec)
    assert theta in schedule.grid
    assert _measured_error(with_theta(codec, theta), grad) <= target + 1e-5
    larger = [t for t in schedule.grid if t > theta]
    if larger:
        assert _measured_error(with_theta(codec, larger[0]), grad) > target - 1e-5


def test_sparsification_error_obeys_the_parseval_bound() -> None:
    grad = torch.randn(4097)
    thetas = (0.0, 0.3, 0.7, 0.95)
    for codec in (FFTCodec(), FFTCodec(chunk=512)):
        errors = sparsification_error(grad, codec, thetas)
        assert errors[0] == 0.0
        assert all(e <= math.sqrt(t) + 1e-6 for e, t in zip(errors, thetas, strict=True))
        assert errors == sorted(errors)


def test_error_budget_fallbacks() -> None:
    schedule = ErrorBudgetTheta(target_rel_error=1e-9, grid=(0.9, 0.5))
    assert schedule.grid == (0.5, 0.9)  # normalised: sorted, deduplicated
    assert schedule.choose(torch.randn(100), FFTCodec()) == 0.5  # none meets: the smallest
    assert ErrorBudgetTheta(0.1).choose(torch.zeros(100), FFTCodec()) == 0.99  # nothing to lose
    bad = torch.randn(100)
    bad[0] = math.inf
    assert schedule.choose(bad, TopKCodec()) == 0.5
    with pytest.raises(ConfigError, match="no θ"):
        schedule.choose(torch.randn(10), QSGDCodec())
    for kwargs in ({"target_rel_error": 0.0}, {"grid": ()}, {"grid": (1.0,)}):
        with pytest.raises(ConfigError, match="ErrorBudgetTheta"):
            ErrorBudgetTheta(**kwargs)  # type: ignore[arg-type]


def test_with_theta() -> None:
    assert with_theta(FFTCodec(theta=0.9, bits=4), 0.5) == FFTCodec(theta=0.5, bits=4)
    assert with_theta(TopKCodec(select="sampled"), 0.75) == TopKCodec(ratio=0.25, select="sampled")
    with pytest.raises(ConfigError, match="no θ"):
        with_theta(QSGDCodec(), 0.5)
    with pytest.raises(ConfigError, match=r"\[0, 1\)"):
        with_theta(FFTCodec(), 1.0)


def test_schedule_state_round_trip() -> None:
    state = ScheduleState()
    for _ in range(5):
        state.advance()
    restored = ScheduleState()
    restored.load_state_dict(state.state_dict())
    assert restored.step == 5
    with pytest.raises(ConfigError, match="step"):
        restored.load_state_dict({"step": -1})
