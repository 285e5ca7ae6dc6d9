"""The device cost model: how fast a device computes and copies, named presets, and measurement.

The planner turns FLOPs, bytes written and bytes copied into seconds with a :class:`CostModel`
(SuperNeurons, Wang et al., PPoPP'18 §3.2-3.3: offload what compute hides, recompute what is
cheap). On a real device the profile measures each unit's forward time and the pinned copy
bandwidth in both directions (:func:`measure_copy_bandwidth`, CUDA events, no synchronize in a
hot path); on fake tensors the planner uses a named preset of :data:`DEVICE_PRESETS`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from superneurons.errors import ConfigError

__all__ = [
    "DEVICE_PRESETS",
    "HOST_LINKS",
    "CostModel",
    "EventTimer",
    "HostLink",
    "cost_model",
    "measure_copy_bandwidth",
    "with_host_link",
]

logger = logging.getLogger("superneurons.memory")


@dataclass(frozen=True)
class CostModel:
    """Device speeds the planner converts work into seconds with.

    Attributes:
        bandwidth_bytes_per_s: device -> host (pinned) copy bandwidth.
        flops_per_s: sustained fp32 rate of recomputed layers (roofline compute bound).
        memory_bandwidth_bytes_per_s: device memory bandwidth (roofline memory bound).
        h2d_bytes_per_s: host -> device (pinned) copy bandwidth; ``None``: the same as
            ``bandwidth_bytes_per_s``.
        host_step_s_per_param: the host optimizer's step time per parameter (fused CPU AdamW,
            one thread, measured here: 375 M parameters/s, ``benchmarks/results/
            host_optimizer``; a server CPU's many cores step faster).
        name: the preset it came from (``"custom"`` when built by hand, ``"measured"``).
        memory_bytes: the device's memory (datasheet capacity; 0: not known), the budget
            ``plan`` uses for a language model when no ``--budget`` is given.

    Defaults: the ``a100`` preset (PCIe 4.0 x16 at ~25 GB/s effective; A100 datasheet fp32
    19.5 TFLOP/s and 1.555 TB/s HBM2).
    """

    bandwidth_bytes_per_s: float = 25e9
    flops_per_s: float = 19.5e12
    memory_bandwidth_bytes_per_s: float = 1.555e12
    h2d_bytes_per_s: float | None = None
    name: str = "custom"
    host_step_s_per_param: float = 1 / 375e6
    memory_bytes: int = 0

    def __post_init__(self) -> None:
        for field in ("bandwidth_bytes_per_s", "flops_per_s", "memory_bandwidth_bytes_per_s"):
            if not getattr(self, field) > 0:
                raise ConfigError(f"{field} must be positive, got {getattr(self, field)}")
        if self.h2d_bytes_per_s is not None and not self.h2d_bytes_per_s > 0:
            raise ConfigError(f"h2d_bytes_per_s must be positive, got {self.h2d_bytes_per_s}")
        if self.memory_bytes < 0:
            raise ConfigError(f"memory_bytes must be >= 0, got {self.memory_bytes}")

    def compute_s(self, unit: Any, *, fake: bool) -> float:
        """Forward time of ``unit``: measured for real profiles, a roofline for fake ones."""
        roofline_s = max(
            unit.flops / self.flops_per_s, unit.bytes_written / self.memory_bandwidth_bytes_per_s
        )
        return roofline_s if fake else max(unit.fwd_time_s, roofline_s)

    def unit_seconds(self, profile: Any) -> dict[str, float]:
        """Each unit's forward time, as the planner uses it: robust to timing noise, so the same
        model and batch profiled twice gives the same plan.

        Units of the same shape (forward FLOPs, bytes written, saved bytes: a transformer's
        identical blocks) get the median of their times; each time is then rounded to a
        quarter-octave grid (19% apart), so noise below ~9% moves no unit in the ordering of
        :func:`superneurons.memory.planner.decide.make_plan`. Fake profiles use the roofline alone.
        """
        raw = {u.fqn: self.compute_s(u, fake=profile.fake) for u in profile.units}
        shapes: dict[tuple[int, int, int], list[float]] = {}
        for unit in profile.units:
            shapes.setdefault((unit.flops, unit.bytes_written, unit.saved_bytes), []).append(
                raw[unit.fqn]
            )
        seconds = {}
        for unit in profile.units:
            same = sorted(shapes[(unit.flops, unit.bytes_written, unit.saved_bytes)])
            median = same[len(same) // 2]
            seconds[unit.fqn] = 2 ** (round(4 * math.log2(median)) / 4) if median > 0 else 0.0
        return seconds

    def copy_s(self, nbytes: int) -> float:
        """Device -> host time of ``nbytes`` (the offload in forward)."""
        return nbytes / self.bandwidth_bytes_per_s

    def fetch_s(self, nbytes: int) -> float:
        """Host -> device time of ``nbytes`` (the prefetch in backward)."""
        return nbytes / (self.h2d_bytes_per_s or self.bandwidth_bytes_per_s)


# NOTE: below ~16 KiB a copy's fixed latency (~10 us per cudaMemcpyAsync) outweighs the bytes:
# the tensor pool keeps smaller saved tensors on the device (``PoolConfig.min_offload_bytes``)
# and the predictor models exactly that.
MIN_OFFLOAD_BYTES = 16 * 1024
# NOTE: the same figure for optimizer state in the host pool (``HostOptimizerState``): below
# ~16 KiB a copy's launch latency (~5 us) costs more than the bytes are worth.
MIN_STATE_OFFLOAD_BYTES = 16 * 1024

GIB = 1024**3

# NOTE: literal table; each figure says where it comes from. Memory: the datasheet capacity
# ("80GB" HBM is 80 GiB); the CUDA context and allocator reserve take a few hundred MiB of it.
DEVICE_PRESETS: dict[str, CostModel] = {
    # Copies: pinned host<->device measured on an H100 80GB (torch 2.11+cu130):
    # 41.7 GB/s to host, 54.6 GB/s back. Compute: H100 SXM5 datasheet, fp32 67 TFLOP/s,
    # HBM3 3.35 TB/s, 80 GB.
    "h100": CostModel(
        41.7e9, 67e12, 3.35e12, h2d_bytes_per_s=54.6e9, name="h100", memory_bytes=80 * GIB
    ),
    # A100 40GB datasheet: fp32 19.5 TFLOP/s, HBM2 1.555 TB/s; PCIe 4.0 x16 ~25 GB/s effective
    # pinned each way (32 GB/s theoretical).
    "a100": CostModel(25e9, 19.5e12, 1.555e12, name="a100", memory_bytes=40 * GIB),
    # A100 80GB datasheet: the same fp32 rate, HBM2e 2.039 TB/s.
    "a100-80gb": CostModel(25e9, 19.5e12, 2.039e12, name="a100-80gb", memory_bytes=80 * GIB),
    # GeForce RTX 4090 datasheet: fp32 82.6 TFLOP/s, GDDR6X 1.008 TB/s, 24 GB; PCIe 4.0 x16
    # as the A100's.
    "rtx4090": CostModel(25e9, 82.6e12, 1.008e12, name="rtx4090", memory_bytes=24 * GIB),
    # This project's 2-core EPYC, one thread, measured here (shared machine): 1024^3 fp32
    # matmul 26 GFLOP/s; a 64 MiB tensor copy 2.7 GB/s (read + write 5.4 GB/s). The "host
    # pool" of a CPU device is another buffer in the same DRAM, so a copy is a memcpy.
    "cpu": CostModel(2.7e9, 26e9, 5.4e9, name="cpu"),
}


@dataclass(frozen=True)
class HostLink:
    """A host <-> device link: its datasheet rate per direction and the pinned-copy rate the
    planner assumes (``effective_bytes_per_s``, both directions)."""

    name: str
    datasheet_bytes_per_s: float
    effective_bytes_per_s: float
    source: str


# NOTE: literal table. PCIe: 16 / 32 GT/s per lane x 16 lanes with 128b/130b encoding is 31.5 /
# 63.0 GB/s per direction (PCI-SIG base specifications 4.0 and 5.0); pinned copies reach ~80% of
# that: 25 GB/s assumed for 4.0 (the a100 preset's figure), and for 5.0 the 54.6 GB/s host ->
# device this project measured on an H100 (the h100 preset; 41.7 GB/s the other way) rounded
# down to 50 GB/s. GH200: NVLink-C2C, 900 GB/s bidirectional (450 GB/s per direction, NVIDIA
# GH200 Grace Hopper Superchip datasheet); 80% of it, 360 GB/s, assumed (not measured here).
HOST_LINKS: dict[str, HostLink] = {
    "pcie4-x16": HostLink("pcie4-x16", 31.5e9, 25e9, "PCI-SIG PCIe 4.0: 16 GT/s x16, 128b/130b"),
    "pcie5-x16": HostLink("pcie5-x16", 63.0e9, 50e9, "PCI-SIG PCIe 5.0: 32 GT/s x16, 128b/130b"),
    "gh200-c2c": HostLink("gh200-c2c", 450e9, 360e9, "NVIDIA GH200 datasheet: NVLink-C2C 900 GB/s"),
}


def with_host_link(cost: CostModel, link: str) -> CostModel:
    """``cost`` with both copy rates set to :data:`HOST_LINKS` ``[link]``'s effective rate."""
    if link not in HOST_LINKS:
        raise ConfigError(f"unknown host link {link!r}: use one of {', '.join(HOST_LINKS)}")
    rate = HOST_LINKS[link].effective_bytes_per_s
    return replace(cost, bandwidth_bytes_per_s=rate, h2d_bytes_per_s=rate)


def cost_model(preset: str = "a100", **overrides: Any) -> CostModel:
    """The :data:`DEVICE_PRESETS` entry ``preset``, with fields replaced by ``overrides``."""
    if preset not in DEVICE_PRESETS:
        raise ConfigError(
            f"unknown device preset {preset!r}: use one of {', '.join(DEVICE_PRESETS)}"
        )
    model = DEVICE_PRESETS[preset]
    return replace(model, **overrides) if overrides else model


def measure_copy_bandwidth(
    device: torch.device | str, *, nbytes: int = 256 * 2**20, repeats: int = 3
) -> tuple[float, float]:
    """Pinned (device -> host, host -> device) bandwidth in bytes/s, timed with CUDA events.

    One measurement at profile time, outside any hot path: the only host wait is
    ``Event.synchronize()`` on the last event of the measurement. On a non-CUDA device the
    copy is a memcpy between two host buffers, timed with ``time.perf_counter``.
    """
    import time

    device = torch.device(device)
    if nbytes <= 0 or repeats <= 0:
        raise ConfigError("nbytes and repeats must be positive")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if device.type != "cuda":
        times = []
        for src, dst in ((dev, host), (host, dev)):
            dst.copy_(src)
            t0 = time.perf_counter()
            for _ in range(repeats):
                dst.copy_(src)
            times.append((time.perf_counter() - t0) / repeats)
        return nbytes / times[0], nbytes / times[1]
    rates = []
    for src, dst in ((dev, host), (host, dev)):
        dst.copy_(src, non_blocking=True)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(nbytes * repeats / (start.elapsed_time(end) / 1e3))
    logger.info("pinned copies on %s: %.1f GB/s to host, %.1f GB/s back", device, *rates)
    return rates[0], rates[1]


class EventTimer:
    """Per-unit forward time on CUDA from event pairs, read once after the step (no synchronize
    between ops: ``perf_counter`` around asynchronous launches would time the launch only)."""

    def __init__(self) -> None:
        self.pairs: list[tuple[str, Any, Any]] = []

    def start(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, fqn: str, start: Any) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pairs.append((fqn, start, end))

    def seconds(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        if self.pairs:
            self.pairs[-1][2].synchronize()  # once, after the profiled step
        for fqn, start, end in self.pairs:
            totals[fqn] = totals.get(fqn, 0.0) + start.elapsed_time(end) / 1e3
        return totals
