"""Codec benchmark on real gradients with equal coding on every sparsifier: bits per element on
the wire, approximation error one-shot and after K steps of error feedback, and speed.

The question: does HPDC'20's FFT sparsification (Wang et al., arXiv 1811.08596) approximate
gradients with less error than Top-k at equal communication, and does our transform-adaptive
codec beat both? Bits per element decide nothing unless both sides pay the same coding
(benchmarks/results/codecs/README.md), so every sparsifier here sends its kept coefficients the
same way (:mod:`superneurons.codecs.coding.sparsecode`: 8-bit range-float values, bitmap or
Elias-Fano index, whichever is smaller) and only the basis differs:

* ``ctopk``: compactly coded Top-k (spatial basis);
* ``fft``: 512-element chunks, rFFT bins (HPDC'20's transform);
* ``adaptive``: per 512-element chunk the most compact of spatial / Fourier / DCT.

Each family's kept share is set from ``codec.payload_bytes`` (every byte counted: values,
indices, headers, basis codes) to land at or just under ~0.5, 1, 2 and 4 bits per element.
References at the same budgets: Top-k with the usual fp32 value + int32 index (64 bits per kept
element), and the fixed-width QSGD (512-element buckets), TernGrad, signSGD and range-float,
which appear only at the budgets their width reaches.

Each gradient is cut into DDP-style buckets (:func:`.gradients.bucket_bounds`) and every bucket
is encoded on its own, as a DDP comm hook would. Metrics per (model, setting):
``bits_per_element``, ``rel_error`` ``||g_hat - g|| / ||g||`` and cosine (mean over capture
points), the relative error of the K-step sum of sent updates with error feedback
(``ef_rel_error``: residual carried across K consecutive real gradients, so it equals the final
residual's norm over the sum's) and without it (``noef_rel_error``), and encode/decode GB/s
(fp32 input bytes per second, one thread, median of repeats on the model's first bucket).
:mod:`.report` writes the artifacts.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from superneurons.bench.codecs.gradients import DDP_BUCKET_BYTES, GradientCapture, bucket_bounds
from superneurons.codecs.adaptive import AdaptiveCodec
from superneurons.codecs.cast import Fp16Codec, IdentityCodec
from superneurons.codecs.codec import Codec
from superneurons.codecs.feedback import feedback_step
from superneurons.codecs.qsgd import QSGDCodec
from superneurons.codecs.rangefloat import RangeFloatCodec
from superneurons.codecs.sign import SignSGDCodec
from superneurons.codecs.sparse.compacttopk import CompactTopKCodec
from superneurons.codecs.sparse.fft import FFTCodec
from superneurons.codecs.sparse.topk import TopKCodec
from superneurons.codecs.terngrad import TernGradCodec
from superneurons.errors import ConfigError
from superneurons.schemes.grammar import CODECS

__all__ = [
    "BUDGETS_BITS",
    "CodecBenchConfig",
    "Setting",
    "bench_settings",
    "run_codec_bench",
]

logger = logging.getLogger("superneurons.bench")

BUDGETS_BITS: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
_BISECT_STEPS = 40
# The equally coded sparsifiers: family label -> the codec, its kept share (θ) set per budget.
# NOTE: the whole-bucket rFFT (the paper's literal reading) lost to 512-element chunks at every
# budget on all four zoo models in an earlier run of this benchmark
# (benchmarks/results/codecs/README.md) and is 10-40x slower on DDP's non-smooth bucket lengths,
# so it is left out of the K=20 run.
SPARSE_FAMILIES: dict[str, Codec] = {
    "ctopk": CompactTopKCodec(bits=8, select="sampled", index="auto"),
    "fft": FFTCodec(bits=8, chunk=512, select="sampled", index="auto"),
    "adaptive": AdaptiveCodec(bits=8, chunk=512, select="sampled", index="auto", header="fixed"),
    # the opt-in sparse basis header (a host read per message on CUDA), measured beside it
    "adaptive-sparse": AdaptiveCodec(
        bits=8, chunk=512, select="sampled", index="auto", header="sparse"
    ),
}
# Top-k with the usual fp32 value + int32 index, its ratio set per budget.
_TOPK = TopKCodec(select="sampled")
# Fixed-width codes: placed at the budgets their width reaches.
_FIXED: tuple[Codec, ...] = (
    *(QSGDCodec(levels=levels) for levels in (1, 3, 7, 15)),
    TernGradCodec(),
    SignSGDCodec(),
    RangeFloatCodec(bits=4),
)
# Reference points at no budget.
_REFERENCES: tuple[Codec, ...] = (RangeFloatCodec(bits=8), Fp16Codec(), IdentityCodec())
_NAMES = {cls: name for name, cls in CODECS.items()}


@dataclass(frozen=True)
class CodecBenchConfig:
    """``max_numel`` truncates every gradient (``--quick``); ``ef_window`` caps K."""

    budgets_bits: tuple[float, ...] = BUDGETS_BITS
    bucket_bytes: int = DDP_BUCKET_BYTES
    timing_repeats: int = 5
    max_numel: int | None = None
    ef_window: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.budgets_bits or any(b <= 0 for b in self.budgets_bits):
            raise ConfigError(f"budgets_bits must be positive, got {self.budgets_bits}")
        if self.timing_repeats < 1:
            raise ConfigError(f"timing_repeats must be >= 1, got {self.timing_repeats}")
        if self.max_numel is not None and self.max_numel < 1:
            raise ConfigError(f"max_numel must be >= 1, got {self.max_numel}")
        if self.bucket_bytes < 4:
            raise ConfigError(f"bucket_bytes must be >= 4, got {self.bucket_bytes}")


@dataclass(frozen=True)
class Setting:
    """One codec configuration: ``family`` names the plot line, ``budget_bits`` the target
    (None for reference points such as fp16)."""

    family: str
    codec: Codec
    budget_bits: float | None

    @property
    def spec(self) -> str:
        return self.codec.spec


def _wire_bits(codec: Codec, sizes: Sequence[int]) -> float:
    return 8.0 * sum(codec.payload_bytes(n) for n in sizes) / sum(sizes)


def _fit(make: Callable[[float], Codec], sizes: Sequence[int], budget: float) -> Codec | None:
    """The codec with the largest knob ``x`` in (0, 1] whose wire bits stay <= ``budget``
    (wire bits grow with ``x``), or None when even the smallest does not fit."""
    low, high = 1e-6, 1.0
    if _wire_bits(make(high), sizes) <= budget:
        return make(high)
    if _wire_bits(make(low), sizes) > budget:
        return None
    for _ in range(_BISECT_STEPS):
        mid = (low + high) / 2
        low, high = (mid, high) if _wire_bits(make(mid), sizes) <= budget else (low, mid)
    return make(low)


def _round_kept(x: float) -> float:
    return float(f"{x:.6g}")


def bench_settings(sizes: Sequence[int], budgets_bits: Sequence[float]) -> list[Setting]:
    """Codec settings at each budget for buckets of ``sizes`` elements, plus references."""
    settings: list[Setting] = []
    for budget in budgets_bits:
        for family, base in SPARSE_FAMILIES.items():

            def sparse(keep: float, base: Codec = base) -> Codec:
                theta = min(0.999999, max(0.0, 1.0 - _round_kept(keep)))
                return replace(base, theta=theta)  # type: ignore[type-var]

            codec = _fit(sparse, sizes, budget)
            if codec is not None:
                settings.append(Setting(family, codec, budget))
        topk = _fit(lambda r: replace(_TOPK, ratio=_round_kept(r)), sizes, budget)
        if topk is not None:
            settings.append(Setting("topk (fp32+int32)", topk, budget))
        for codec in _FIXED:
            bits = _wire_bits(codec, sizes)
            # Fixed-width codes sit at their width plus a few % of scales/headers.
            if budget * 0.9 < bits <= budget * 1.05:
                settings.append(Setting(_NAMES[type(codec)], codec, budget))
    for codec in _REFERENCES:
        settings.append(Setting(_NAMES[type(codec)], codec, None))
    return settings


def _encode_decode(codec: Codec, flat: torch.Tensor, bounds: Sequence[tuple[int, int]],
                   generator: torch.Generator) -> tuple[torch.Tensor, int]:  # fmt: skip
    out = torch.empty_like(flat)
    nbytes = 0
    for start, stop in bounds:
        payload = codec.encode(flat[start:stop], generator=generator)
        nbytes += payload.nbytes
        out[start:stop] = codec.decode(payload)
    return out, nbytes


def _rel(approx: torch.Tensor, exact: torch.Tensor) -> float:
    norm = float(exact.norm())
    return float((approx - exact).norm()) / norm if norm > 0 else math.nan


def _accumulated_errors(codec: Codec, window: torch.Tensor, bounds: Sequence[tuple[int, int]],
                        generator: torch.Generator) -> tuple[float, float]:  # fmt: skip
    """Relative error of the K-step sum of sent updates, with and without error feedback."""
    exact = window.sum(0)
    plain = torch.zeros_like(exact)
    fed = torch.zeros_like(exact)
    residuals: list[torch.Tensor | None] = [None] * len(bounds)
    for grad in window:
        plain += _encode_decode(codec, grad, bounds, generator)[0]
        for i, (start, stop) in enumerate(bounds):
            payload, residuals[i] = feedback_step(
                codec, grad[start:stop], residuals[i], generator=generator
            )
            fed[start:stop] += codec.decode(payload)
    return _rel(fed, exact), _rel(plain, exact)


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (allocations, FFT plans)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _truncate(capture: GradientCapture, max_numel: int | None) -> tuple[list[int], int]:
    if max_numel is None or capture.numel <= max_numel:
        return list(capture.numels), capture.numel
    numels, total = [], 0
    for n in capture.numels:
        take = min(n, max_numel - total)
        if take <= 0:
            break
        numels.append(take)
        total += take
    return numels, total


def run_codec_bench(
    captures: Sequence[GradientCapture],
    config: CodecBenchConfig,
    *,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One record per (model, codec setting); see the module docstring for the fields."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # encode/decode GB/s are per core
    try:
        records = []
        for capture in captures:
            numels, numel = _truncate(capture, config.max_numel)
            bounds = bucket_bounds(numels, config.bucket_bytes)
            sizes = [stop - start for start, stop in bounds]
            steps = sorted(capture.grads)
            window = capture.grads[steps[-1]][: config.ef_window or None, :numel]
            for setting in bench_settings(sizes, config.budgets_bits):
                if progress is not None:
                    progress(f"{capture.model} {setting.spec}")
                records.append(_measure(capture, setting, steps, numel, bounds, window, config))
        return records
    finally:
        torch.set_num_threads(threads)


def _measure(capture: GradientCapture, setting: Setting, steps: list[int], numel: int,
             bounds: list[tuple[int, int]], window: torch.Tensor,
             config: CodecBenchConfig) -> dict[str, Any]:  # fmt: skip
    codec = setting.codec
    generator = torch.Generator().manual_seed(config.seed)
    errors, cosines, wire_bytes = {}, [], 0
    for step in steps:
        grad = capture.grads[step][0, :numel]
        approx, wire_bytes = _encode_decode(codec, grad, bounds, generator)
        errors[step] = _rel(approx, grad)
        cosines.append(float(torch.nn.functional.cosine_similarity(approx, grad, dim=0)))
    ef_error, plain_error = _accumulated_errors(codec, window, bounds, generator)
    first = capture.grads[steps[0]][0, bounds[0][0] : bounds[0][1]].clone()
    payload = codec.encode(first, generator=generator)
    encode_s = _median_s(lambda: codec.encode(first, generator=generator), config.timing_repeats)
    decode_s = _median_s(lambda: codec.decode(payload), config.timing_repeats)
    input_bytes = 4 * first.numel()
    return {
        "model": capture.model,
        "codec": _NAMES[type(setting.codec)],
        "family": setting.family,
        "spec": setting.spec,
        "budget_bits": setting.budget_bits,
        "bits_per_element": 8.0 * wire_bytes / numel,
        "rel_error": statistics.fmean(errors.values()),
        "rel_error_by_step": errors,
        "cosine": statistics.fmean(cosines),
        "encode_gbps": input_bytes / encode_s / 1e9,
        "decode_gbps": input_bytes / decode_s / 1e9,
        "ef_rel_error": ef_error,
        "noef_rel_error": plain_error,
        "ef_steps": int(window.shape[0]),
        "ef_at_step": steps[-1],
        "numel": numel,
        "bucket_bytes": config.bucket_bytes,
        "n_buckets": len(bounds),
        "timed_bucket_numel": first.numel(),
    }
