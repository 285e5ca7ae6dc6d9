"""Simulate zoo models on fake tensors: profiles without memory, and the largest depth / batch.

:func:`profile_zoo` builds a zoo model, its optimizer and a batch under ``FakeTensorMode`` (fake
*cpu* tensors; byte sizes are device independent) and profiles one step. Nothing is allocated,
so a 12 GiB step costs only the Python time of its ops (~0.1 ms each).

:func:`max_fitting` finds the largest depth (the ``[6, 32, n, 6]`` ResNet family of SuperNeurons,
Wang et al., PPoPP'18 §4) or batch whose smallest predicted peak under a strategy fits a budget,
without profiling every candidate: every middle block of stage 3 is identical (same shapes, same
ops), so once stage 3 holds the peak the strategy's minimal peak is *affine* in n; likewise
activations are affine in the batch. It profiles three sizes, fits the line through the two
largest, reports the third's residual, and solves for the largest fitting size. Callers validate
against a direct profile at the answer where they can afford it (``verify=True`` for batches).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from superneurons.errors import ConfigError
from superneurons.memory.planner import CostModel, min_peak_bytes
from superneurons.memory.profile import profile_step
from superneurons.memory.profile_types import Profile

__all__ = ["OPTIMIZERS", "FitResult", "max_fitting", "profile_zoo", "zoo_peaks"]

logger = logging.getLogger("superneurons.memory")

# NOTE: literal table; SGD momentum 0.9 is the SuperNeurons/ResNet training recipe.
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "none": lambda params: torch.optim.SGD(params, lr=0.1),
}


def profile_zoo(
    name: str, *, batch_size: int, optimizer: str = "sgd", **model_kwargs: Any
) -> Profile:
    """Profile one step of zoo model ``name`` on fake tensors (no real memory)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from superneurons.models.zoo import build_model, default_loss, model_input

    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    mode = FakeTensorMode()
    with mode:
        model = build_model(name, **model_kwargs)
        opt = None if optimizer == "none" else OPTIMIZERS[optimizer](model.parameters())
        inputs, targets = model_input(name, batch_size, **model_kwargs)
    return profile_step(model, inputs, targets, default_loss(name), opt, fake_mode=mode)


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
    """

    strategy: str
    size: int
    intercept_bytes: float
    slope_bytes: float
    samples: tuple[tuple[int, int], ...]
    residual: float
    seconds: float


def max_fitting(
    peaks: Callable[[int], dict[str, int]],
    strategies: tuple[str, ...],
    *,
    budget_bytes: int,
    sizes: tuple[int, int, int],
    progress: Callable[[str], None] | None = None,
) -> dict[str, FitResult]:
    """Largest size per strategy with ``peaks(size)[strategy] <= budget_bytes`` (affine fit).

    ``peaks(size)`` returns each strategy's smallest predicted peak at ``size`` (e.g.
    ``min_peak_bytes(profile_zoo(...))``); it is called once per sample size.
    """
    if budget_bytes <= 0:
        raise ConfigError(f"budget must be positive, got {budget_bytes}")
    start_s = time.perf_counter()
    small, mid, large = sorted(sizes)
    samples: dict[int, dict[str, int]] = {}
    for size in (small, mid, large):
        t0 = time.perf_counter()
        samples[size] = peaks(size)
        if progress is not None:
            progress(f"profiled size {size} in {time.perf_counter() - t0:.1f} s")
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
        results[strategy] = FitResult(
            strategy=strategy,
            size=size,
            intercept_bytes=intercept,
            slope_bytes=slope,
            samples=tuple((s, samples[s][strategy]) for s in (small, mid, large)),
            residual=residual,
            seconds=time.perf_counter() - start_s,
        )
    return results


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
        return min_peak_bytes(profile_zoo(name, **kwargs), cost=cost)

    return peaks
