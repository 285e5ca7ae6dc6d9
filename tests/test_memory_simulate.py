"""Fake-tensor simulation: zoo profiles without memory, and the affine depth / batch search."""

from __future__ import annotations

import pytest

from superneurons.errors import ConfigError
from superneurons.memory.planner import min_peak_bytes
from superneurons.memory.simulate import max_fitting, profile_zoo


def _peaks(n: int) -> dict[str, int]:
    profile = profile_zoo("resnet", batch_size=2, layers=(1, 1, n, 1), image_size=32)
    return min_peak_bytes(profile)


def test_depth_search_matches_direct_profiles() -> None:
    strategies = ("eager", "checkpoint")
    probe = _peaks(5)
    budget = (probe["eager"] + probe["checkpoint"]) // 2
    fits = max_fitting(_peaks, strategies, budget_bytes=budget, sizes=(2, 3, 4))
    for strategy, fit in fits.items():
        assert fit.residual < 0.01  # identical blocks: the peak is affine in n
        predicted = fit.intercept_bytes + fit.slope_bytes * 5
        assert abs(predicted - probe[strategy]) <= 0.01 * probe[strategy]
    assert fits["checkpoint"].size > fits["eager"].size  # recompute goes deeper
    eager_n = fits["eager"].size
    assert _peaks(eager_n)["eager"] <= budget < _peaks(eager_n + 1)["eager"]


def test_profile_zoo_uses_no_real_memory_and_counts_optimizer_state() -> None:
    sgd = profile_zoo("resnet", batch_size=2, layers=(1, 1, 1, 1), image_size=32)
    adam = profile_zoo(
        "resnet", batch_size=2, layers=(1, 1, 1, 1), image_size=32, optimizer="adamw"
    )
    assert sgd.fake and sgd.optimizer_state_bytes > 0
    assert adam.optimizer_state_bytes >= 2 * sgd.optimizer_state_bytes  # exp_avg + exp_avg_sq
    with pytest.raises(ConfigError, match="optimizer"):
        profile_zoo("resnet", batch_size=2, optimizer="lion")


def test_bad_budget_rejected() -> None:
    with pytest.raises(ConfigError, match="positive"):
        max_fitting(lambda n: {"eager": n}, ("eager",), budget_bytes=0, sizes=(1, 2, 3))
