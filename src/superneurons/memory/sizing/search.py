"""The largest depth / batch / sequence that fits a budget, per memory strategy (fake tensors).

:func:`max_fitting` finds the largest depth (the ``[6, 32, n, 6]`` ResNet family of SuperNeurons,
Wang et al., PPoPP'18 §4) or batch whose smallest predicted peak under a strategy fits a budget,
without profiling every candidate: every middle block of stage 3 is identical (same shapes, same
ops), so once stage 3 holds the peak the strategy's minimal peak is *affine* in n; likewise
activations are affine in the batch. It profiles three sizes, fits the line through the two
largest, reports the third's residual, and solves for the largest fitting size. Callers validate
against a direct profile at the answer where they can afford it (``verify=True`` for batches).

:func:`largest_fitting` is ``superneurons plan --max-depth / --max-batch / --max-seq-len``:
batches and sequence lengths are checked by direct profiles there; sequence lengths are searched
in multiples of :data:`SEQ_QUANTUM` tokens (a quarter of the positions for configurations with
fewer than 4 x that) and stop at the configuration's positions: nothing beyond them is profiled,
unless :class:`LMSearch` ``beyond_positions`` asks what memory allows past them (rotary
positions only: ``max_seq_len_memory`` beside ``max_seq_len``). ``fit_depth`` profiles shallow
copies of a deep model and extrapolates in depth (:mod:`.depth_fit`).
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
from superneurons.memory.sizing.depth_fit import (
    CHECK_LAYERS,
    PROBE_LAYERS,
    depth_fit_residual,
    extrapolated,
    num_layers,
    with_layers,
)
from superneurons.memory.sizing.llm import (
    LMStep,
    profile_causal_lm_below,
    require_rotary_positions,
)
from superneurons.memory.sizing.simulate import profile_zoo
from superneurons.memory.sizing.target import LMTarget, Target, ZooTarget

__all__ = [
    "SEQ_QUANTUM",
    "FitResult",
    "LMSearch",
    "largest_fitting",
    "lm_peaks",
    "max_fitting",
    "zoo_peaks",
]

DEPTH_SAMPLES = (24, 48, 72)  # stage-3 blocks n; the peak sits in stage 3 from n ~ 20 on
BATCH_SAMPLES = (4, 8, 16)
SEQ_QUANTUM = 256  # max_seq_len answers in multiples of this many tokens


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


def lm_peaks(
    config: Any,
    step: LMStep,
    axis: str,
    *,
    cost: CostModel | None = None,
    quantum: int = 1,
    variants: tuple[str, ...] = (),
    fit_depth: bool = False,
    check_positions: bool = True,
) -> Callable[[int], dict[str, int]]:
    """``f(size)`` -> each strategy's smallest peak for a causal LM (:mod:`.llm`): ``axis``
    ``"seq_len"`` (``size * quantum`` tokens) or ``"batch"`` (``size`` sequences). With fused
    attention every activation is linear in ``B x T``, so the peak is affine in either (below
    the largest layer, ``variants`` of ``memory.profiling.below``, chunk sizes step in powers of
    two: nearly affine, which the caller's direct profiles check). ``fit_depth``: profile
    shallow copies and extrapolate to the configuration's depth (:mod:`.depth_fit`);
    ``check_positions=False``: sequences past the configuration's positions are profiled."""
    if axis not in ("seq_len", "batch"):
        raise ConfigError(f"axis must be 'seq_len' or 'batch', got {axis!r}")

    def sized(size: int) -> LMStep:
        if axis == "seq_len":
            return dataclasses.replace(step, seq_len=size * quantum)
        return dataclasses.replace(step, batch_size=size)

    def at_depth(size: int, layers: int | None) -> dict[str, int]:
        shaped = config if layers is None else with_layers(config, layers)
        plain, chunked = profile_causal_lm_below(
            shaped, sized(size), variants=variants, check_positions=check_positions
        )
        return min_peak_bytes(plain, cost=cost, chunked=chunked)

    def peaks(size: int) -> dict[str, int]:
        if not fit_depth:
            return at_depth(size, None)
        return extrapolated(lambda layers: at_depth(size, layers), num_layers(config))

    return peaks


@dataclass(frozen=True)
class LMSearch:
    """How ``plan --max-seq-len / --max-batch`` searches a causal LM.

    Attributes:
        beyond_positions: (``seq_len``, rotary positions only) search memory past the
            configuration's positions too: ``max_seq_len_memory`` (``max_seq_len`` still stops
            at the positions).
        fit_depth: profile shallow copies and extrapolate to the depth (:mod:`.depth_fit`),
            reporting the line's residual at :data:`~.depth_fit.CHECK_LAYERS` layers.
    """

    beyond_positions: bool = False
    fit_depth: bool = False


def largest_fitting(
    target: Target,
    axis: str,
    *,
    budget_bytes: int,
    strategies: tuple[str, ...],
    cost: CostModel,
    progress: Callable[[str], None] | None = None,
    lm: LMSearch | None = None,
) -> list[dict[str, Any]]:
    """The largest ``axis`` (``"depth"``: the ``[6, 32, n, 6]`` ResNet; ``"batch"``;
    ``"seq_len"``: a causal LM's) whose smallest predicted peak fits ``budget_bytes``, per
    strategy: the records ``plan --max-* --json`` prints. ``lm``: a causal LM's options."""
    if axis not in ("depth", "batch", "seq_len"):
        raise ConfigError(f"axis must be 'depth', 'batch' or 'seq_len', got {axis!r}")
    if isinstance(target, LMTarget):
        if axis == "depth":
            raise ConfigError("--max-depth searches the [6, 32, n, 6] ResNet family")
        return _lm_search(target, axis, strategies, budget_bytes, cost, progress, lm or LMSearch())
    if lm is not None and lm != LMSearch():
        raise ConfigError("--beyond-positions and --fit-depth apply to --model hf:... only")
    if axis == "seq_len":
        raise ConfigError("--max-seq-len applies to --model hf:... only")
    return _zoo_search(target, axis, strategies, budget_bytes, cost, progress)


def _lm_search(
    target: LMTarget,
    axis: str,
    strategies: tuple[str, ...],
    budget_bytes: int,
    cost: CostModel,
    progress: Callable[[str], None] | None,
    lm: LMSearch,
) -> list[dict[str, Any]]:
    key = f"max_{axis}"
    positions = target.max_positions if axis == "seq_len" else None
    beyond = _beyond_positions(target, axis, lm)
    limit = None if beyond else positions
    quantum = SEQ_QUANTUM if axis == "seq_len" else 1
    if positions is not None and positions < 4 * SEQ_QUANTUM:  # a small configuration
        quantum = max(positions // 4, 1)
    peaks = lm_peaks(
        target.config, target.step, axis, cost=cost, quantum=quantum, variants=target.variants,
        fit_depth=lm.fit_depth, check_positions=not beyond,
    )  # fmt: skip
    top = (positions or 64 * SEQ_QUANTUM) // quantum if axis == "seq_len" else 8
    sizes = (max(top // 4, 1), max(top // 2, 2), max(top, 3))
    fits = max_fitting(
        peaks,
        strategies,
        budget_bytes=budget_bytes,
        sizes=sizes,
        progress=progress,
        verify=True,
        limit=limit // quantum if limit is not None else None,
    )
    extra = {}
    if lm.fit_depth:
        extra = _depth_fields(target, axis, sizes[-1] * quantum, cost)
    records: list[dict[str, Any]] = []
    for strategy, fit in fits.items():
        size = fit.size * quantum
        found = {"strategy": strategy, **target.record(), key: size, "budget_bytes": budget_bytes}
        found["below"] = target.below
        if positions is not None:  # the answer is the configuration's positions
            found[key] = min(size, positions)
            found["limited_by_positions"] = size + quantum > positions
        if beyond:  # what memory allows, past the positions
            found[f"{key}_memory"] = size
        found.update(fit_residual=fit.residual, slope_bytes=fit.slope_bytes)
        found.update(intercept_bytes=fit.intercept_bytes, device_preset=cost.name, **extra)
        records.append(found)
    return records


def _beyond_positions(target: LMTarget, axis: str, lm: LMSearch) -> bool:
    """``--beyond-positions``, checked: sequences, a bounded configuration, rotary positions."""
    if not lm.beyond_positions:
        return False
    if axis != "seq_len":
        raise ConfigError("--beyond-positions applies to --max-seq-len only")
    require_rotary_positions(target.config)
    return target.max_positions is not None


def _depth_fields(target: LMTarget, axis: str, size: int, cost: CostModel) -> dict[str, Any]:
    """``fit_depth`` (the layers profiled) and ``depth_fit_residual`` (the line's relative
    error at :data:`CHECK_LAYERS` layers against a direct profile, at ``size``)."""
    step = target.step
    sized = (
        dataclasses.replace(step, seq_len=size)
        if axis == "seq_len"
        else dataclasses.replace(step, batch_size=size)
    )

    def peaks_at(layers: int) -> dict[str, int]:
        plain, chunked = profile_causal_lm_below(
            with_layers(target.config, layers), sized, variants=target.variants,
            check_positions=False,
        )  # fmt: skip
        return min_peak_bytes(plain, cost=cost, chunked=chunked)

    return {
        "fit_depth": [*PROBE_LAYERS, num_layers(target.config)],
        "depth_fit_residual": depth_fit_residual(peaks_at),
        "depth_fit_checked_at": {"layers": CHECK_LAYERS, axis: size},
    }


def _zoo_search(
    target: ZooTarget,
    axis: str,
    strategies: tuple[str, ...],
    budget_bytes: int,
    cost: CostModel,
    progress: Callable[[str], None] | None,
) -> list[dict[str, Any]]:
    kwargs = target.model_kwargs()
    kwargs.pop("depth", None)
    if axis == "depth":
        if target.name != "resnet":
            raise ConfigError("--max-depth searches the [6, 32, n, 6] family: use --model resnet")
        peaks = zoo_peaks(
            target.name,
            "n",
            cost=cost,
            optimizer=target.optimizer,
            batch_size=target.batch_size,
            **kwargs,
        )
        sizes = DEPTH_SAMPLES
    else:
        peaks = zoo_peaks(target.name, "batch", cost=cost, optimizer=target.optimizer, **kwargs)
        sizes = BATCH_SAMPLES
    # NOTE: batches are verified by direct profiles (cheap); depths trust the affine fit,
    # which is exact once stage 3 holds the peak (validated in `superneurons bench deeper`).
    fits = max_fitting(
        peaks,
        strategies,
        budget_bytes=budget_bytes,
        sizes=sizes,
        progress=progress,
        verify=axis == "batch",
    )
    depth = axis == "depth"
    return [_zoo_row(target, fit, budget_bytes, depth) for fit in fits.values()]


def _zoo_row(
    target: ZooTarget, fit: FitResult, budget_bytes: int, max_depth: bool
) -> dict[str, Any]:
    from superneurons.models.resnet import n_to_depth

    record: dict[str, Any] = {
        "strategy": fit.strategy,
        "model": target.name,
        "budget_bytes": budget_bytes,
        "fit_residual": fit.residual,
        "slope_bytes": fit.slope_bytes,
        "intercept_bytes": fit.intercept_bytes,
    }
    if max_depth:
        record.update(
            max_depth=n_to_depth(fit.size) if fit.size else 0, n=fit.size, batch=target.batch_size
        )
    else:
        record.update(max_batch=fit.size)
    return record
