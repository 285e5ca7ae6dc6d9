"""The largest depth / batch / sequence that fits a budget, per memory strategy (fake tensors).

:func:`max_fitting` finds the largest depth (the ``[6, 32, n, 6]`` ResNet family of SuperNeurons,
Wang et al., PPoPP'18 §4) or batch whose smallest predicted peak under a strategy fits a budget,
without profiling every candidate: every middle block of stage 3 is identical (same shapes, same
ops), so once stage 3 holds the peak the strategy's minimal peak is *affine* in n; likewise
activations are affine in the batch. It profiles three sizes, fits the line through the two
largest, reports the third's residual, and solves for the largest fitting size. Callers validate
against a direct profile at the answer where they can afford it (``verify=True`` for batches).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from superneurons.errors import ConfigError
from superneurons.memory.planner.cost import CostModel
from superneurons.memory.planner.decide import min_peak_bytes
from superneurons.memory.profile_types import Profile
from superneurons.memory.sizing.llm import LMStep, profile_causal_lm_below
from superneurons.memory.sizing.simulate import profile_zoo

__all__ = ["FitResult", "lm_peaks", "max_fitting", "profile_for_strategy", "zoo_peaks"]


@dataclass(frozen=True)
class FitResult:
    """The largest size that fits, and how it was found.

    Attributes:
        strategy: planner strategy.
        size: largest depth-family ``n`` or batch whose predicted peak fits (0: none fits).
        intercept_bytes / slope_bytes: the fitted ``peak = intercept + slope * size``.
        samples: ``(size, peak_bytes)`` of the profiled sizes.
        residual: relative error of the fit at the smallest sample.
        seconds: wall time of the search.
        verified: the size was checked (and corrected) by direct profiles.
    """

    strategy: str
    size: int
    intercept_bytes: float
    slope_bytes: float
    samples: tuple[tuple[int, int], ...]
    residual: float
    seconds: float
    verified: bool = False


def max_fitting(
    peaks: Callable[[int], dict[str, int]],
    strategies: tuple[str, ...],
    *,
    budget_bytes: int,
    sizes: tuple[int, int, int],
    progress: Callable[[str], None] | None = None,
    verify: bool = False,
    limit: int | None = None,
) -> dict[str, FitResult]:
    """Largest size per strategy with ``peaks(size)[strategy] <= budget_bytes`` (affine fit).

    ``peaks(size)`` returns each strategy's smallest predicted peak at ``size`` (e.g.
    ``min_peak_bytes(profile_zoo(...))``); it is called once per sample size. With ``verify``
    the fitted answer is then checked by direct calls (``size`` fits, ``size + 1`` does not)
    and corrected by a bracketing search where the peak is not affine (``verified=True``).
    ``limit``: the largest size there is (a configuration's positions): answers stop there and
    nothing beyond it is called.
    """
    if budget_bytes <= 0:
        raise ConfigError(f"budget must be positive, got {budget_bytes}")
    start_s = time.perf_counter()
    small, mid, large = sorted(sizes)
    samples: dict[int, dict[str, int]] = {}

    def peak(size: int, strategy: str) -> int:
        if size not in samples:
            t0 = time.perf_counter()
            samples[size] = peaks(size)
            if progress is not None:
                progress(f"profiled size {size} in {time.perf_counter() - t0:.1f} s")
        return samples[size][strategy]

    for size in (small, mid, large):
        peak(size, strategies[0])
    results = {}
    for strategy in strategies:
        y_mid, y_large = samples[mid][strategy], samples[large][strategy]
        slope = (y_large - y_mid) / (large - mid)
        intercept = y_large - slope * large
        fit_small = intercept + slope * small
        residual = abs(fit_small - samples[small][strategy]) / max(samples[small][strategy], 1)
        if slope <= 0:
            size = large if y_large <= budget_bytes else 0
        else:
            size = max(int(math.floor((budget_bytes - intercept) / slope)), 0)
        if limit is not None:
            size = min(size, limit)
        if verify:
            fits = functools.partial(_fits, peak, strategy, budget_bytes, limit)
            size = _bracket(fits, max(size, 1))
        results[strategy] = FitResult(
            strategy=strategy,
            size=size,
            intercept_bytes=intercept,
            slope_bytes=slope,
            samples=tuple((s, samples[s][strategy]) for s in (small, mid, large)),
            residual=residual,
            seconds=time.perf_counter() - start_s,
            verified=verify,
        )
    return results


def _fits(
    peak: Callable[[int, str], int], strategy: str, budget_bytes: int, limit: int | None, size: int
) -> bool:
    return (limit is None or size <= limit) and peak(size, strategy) <= budget_bytes


def _bracket(fits: Callable[[int], bool], guess: int) -> int:
    """Largest ``n >= 1`` with ``fits(n)`` (0 if none), searching outward from ``guess``;
    assumes ``fits`` is monotone (a larger model or batch never needs less memory)."""
    if fits(guess):
        low, step = guess, 1
        while fits(low + step):
            low, step = low + step, step * 2
        high = low + step  # fails
    else:
        high, step = guess, 1
        while True:
            candidate = high - step
            if candidate < 1:
                if high == 1 or not fits(1):
                    return 0
                low = 1
                break
            if fits(candidate):
                low = candidate
                break
            high, step = candidate, step * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def zoo_peaks(
    name: str, axis: str, *, cost: CostModel | None = None, **fixed: Any
) -> Callable[[int], dict[str, int]]:
    """``f(size)`` -> each strategy's smallest peak; ``axis`` is ``"n"`` (stage-3 blocks of the
    ``[6, 32, n, 6]`` ResNet) or ``"batch"``; ``fixed`` holds the other :func:`profile_zoo`
    arguments (``batch_size`` for ``"n"``)."""
    if axis not in ("n", "batch"):
        raise ConfigError(f"axis must be 'n' or 'batch', got {axis!r}")

    def peaks(size: int) -> dict[str, int]:
        kwargs = dict(fixed)
        if axis == "n":
            kwargs["layers"] = (6, 32, size, 6)
        else:
            kwargs["batch_size"] = size
        # NOTE: blocks suit checkpointing (a layer's checkpoint is its input: no saving);
        # splitting the largest blocks into layers suits the pool: each strategy its best
        block = min_peak_bytes(profile_zoo(name, granularity="block", **kwargs), cost=cost)
        split = min_peak_bytes(profile_zoo(name, granularity="split", **kwargs), cost=cost)
        return {s: min(block[s], split[s]) for s in block}

    return peaks


def profile_for_strategy(
    name: str, strategy: str, *, cost: CostModel | None = None, **kwargs: Any
) -> tuple[Profile, str]:
    """The zoo profile (block or split granularity) whose floor for ``strategy`` is lower, and
    that granularity's name: blocks suit checkpointing, split blocks suit the tensor pool.
    This is what ``--granularity auto`` means (and nothing else does)."""
    found = []
    for granularity in ("block", "split"):
        profile = profile_zoo(name, granularity=granularity, **kwargs)
        minima = min_peak_bytes(profile, cost=cost)
        floor = minima[strategy] if strategy in minima else min(minima.values())
        found.append((floor, granularity, profile))
    floor, granularity, profile = min(found, key=lambda f: f[0])
    return profile, granularity


def lm_peaks(
    config: Any,
    step: LMStep,
    axis: str,
    *,
    cost: CostModel | None = None,
    quantum: int = 1,
    variants: tuple[str, ...] = (),
) -> Callable[[int], dict[str, int]]:
    """``f(size)`` -> each strategy's smallest peak for a causal LM (:mod:`.llm`): ``axis``
    ``"seq_len"`` (``size * quantum`` tokens) or ``"batch"`` (``size`` sequences). With fused
    attention every activation is linear in ``B x T``, so the peak is affine in either (below
    the largest layer, ``variants`` of ``memory.below``, chunk sizes step in powers of two:
    nearly affine, which the caller's direct profiles check)."""
    if axis not in ("seq_len", "batch"):
        raise ConfigError(f"axis must be 'seq_len' or 'batch', got {axis!r}")

    def peaks(size: int) -> dict[str, int]:
        if axis == "seq_len":
            sized = dataclasses.replace(step, seq_len=size * quantum)
        else:
            sized = dataclasses.replace(step, batch_size=size)
        plain, chunked = profile_causal_lm_below(config, sized, variants=variants)
        return min_peak_bytes(plain, cost=cost, chunked=chunked)

    return peaks
