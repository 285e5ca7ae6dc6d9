"""Codec throughput on one device: encode/decode GB/s of every codec at 4 MiB and 100 MiB.

GB/s counts fp32 *input* bytes per second (``4 * numel / seconds``). On CUDA each repetition is bracketed by ``torch.cuda.Event`` s on the current
stream after a warm-up (cuFFT plans, allocator); the codec itself never synchronises (tested by
``tests/test_codec_device.py`` under ``set_sync_debug_mode("error")``), and only the harness
waits on the end event. On the CPU the harness uses one thread and records both wall time and
the thread's CPU time (``time.thread_time``): on a shared machine the CPU time is the better
estimate of a quiet machine's wall time. Reported: the median over ``repeats``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from superneurons.bench.artifacts import markdown_table, write_json, write_markdown
from superneurons.codecs.codec import Codec
from superneurons.errors import ConfigError
from superneurons.schemes.grammar import CODECS, parse_codec

__all__ = ["SPEED_SPECS", "SpeedConfig", "measure_codec_speed", "write_speed_artifacts"]

# Every codec at its defaults (sparsifiers near 1 bit per element), plus fft's exact selection.
SPEED_SPECS: tuple[str, ...] = (
    "fft",
    "fft:select=exact",
    "adaptive",
    "adaptive:header=sparse",
    "ctopk",
    "topk",
    "qsgd",
    "terngrad",
    "signsgd",
    "rangefloat",
    "fp16",
    "bf16",
    "identity",
)


@dataclass(frozen=True)
class SpeedConfig:
    """``device``: "cpu" or "cuda[:i]"; ``sizes_mib``: fp32 bucket sizes; ``repeats``: timed
    repetitions per (codec, size) after one warm-up; ``specs``: the codecs, parsed once
    (:attr:`codecs`)."""

    device: str = "cpu"
    sizes_mib: tuple[float, ...] = (4.0, 100.0)
    repeats: int = 5
    specs: tuple[str, ...] = SPEED_SPECS
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.sizes_mib or any(s <= 0 for s in self.sizes_mib):
            raise ConfigError(f"sizes_mib must be positive, got {self.sizes_mib}")
        if self.repeats < 1:
            raise ConfigError(f"repeats must be >= 1, got {self.repeats}")
        kind = torch.device(self.device).type
        if kind not in ("cpu", "cuda"):
            raise ConfigError(f"device must be cpu or cuda, got {self.device!r}")
        self.codecs  # noqa: B018  (parses every spec now: a bad one fails before measuring)

    @cached_property
    def codecs(self) -> tuple[Codec, ...]:
        return tuple(parse_codec(spec) for spec in self.specs)


_NAMES = {cls: name for name, cls in CODECS.items()}


def _time_cpu(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median wall s, median thread CPU s) after one warm-up call."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(wall), statistics.median(cpu)


def _time_cuda(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds between two CUDA events around ``fn`` (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()  # the harness waits, the codec does not
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure_codec_speed(
    config: SpeedConfig, *, progress: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """One record per (size, codec): GB/s both ways, times, payload bits per element."""
    device = torch.device(config.device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # GB/s per core
    try:
        records = []
        for size_mib in config.sizes_mib:
            numel = int(size_mib * 2**20) // 4
            generator = torch.Generator(device=device).manual_seed(config.seed)
            grad = torch.randn(numel, device=device, generator=generator)
            for spec, codec in zip(config.specs, config.codecs, strict=True):
                if progress is not None:
                    progress(f"{size_mib:g} MiB {spec}")
                records.append(_measure(codec, grad, generator, config))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        return records
    finally:
        torch.set_num_threads(threads)


def _measure(
    codec: Codec, grad: torch.Tensor, generator: torch.Generator, config: SpeedConfig
) -> dict[str, Any]:
    payload = codec.encode(grad, generator=generator)

    def encode() -> object:
        return codec.encode(grad, generator=generator)

    def decode() -> object:
        return codec.decode(payload)

    numel = grad.numel()
    record: dict[str, Any] = {
        "spec": codec.spec,
        "codec": _NAMES[type(codec)],
        "device": str(grad.device),
        "size_mib": 4 * numel / 2**20,
        "numel": numel,
        "bits_per_element": 8 * payload.nbytes / numel,
        "payload_device": str(payload.data.device),
    }
    for name, fn in (("encode", encode), ("decode", decode)):
        if grad.device.type == "cuda":
            seconds = _time_cuda(fn, config.repeats)
            record[f"{name}_s"] = seconds
        else:
            seconds, cpu_s = _time_cpu(fn, config.repeats)
            record[f"{name}_wall_s"] = seconds
            record[f"{name}_cpu_s"] = cpu_s
            record[f"{name}_gbps_cpu_time"] = 4 * numel / cpu_s / 1e9 if cpu_s > 0 else None
        record[f"{name}_gbps"] = 4 * numel / seconds / 1e9
    return record


def write_speed_artifacts(
    records: Sequence[dict[str, Any]], out_dir: Path, **extra: Any
) -> dict[str, Path]:
    """``speed-<device>.json`` and ``speed-<device>.md`` under ``out_dir``."""
    out_dir = Path(out_dir)
    device = records[0]["device"].split(":")[0] if records else "none"
    json_path = write_json(out_dir / f"speed-{device}.json", records, **extra)
    columns = ["size_mib", "spec", "bits_per_element", "encode_gbps", "decode_gbps"]
    if device == "cpu":
        columns += ["encode_gbps_cpu_time", "decode_gbps_cpu_time"]
    body = (
        f"Encode/decode throughput on {device}: fp32 input bytes per second, median of the "
        "timed repetitions after a warm-up. "
        + (
            "CUDA: torch.cuda.Event timing, no synchronisation inside the codecs."
            if device == "cuda"
            else "CPU: one thread; `*_cpu_time` columns divide by the thread's CPU time "
            "(the better estimate on a shared machine)."
        )
        + "\n\n"
        + markdown_table(records, columns)
    )
    md_path = write_markdown(out_dir / f"speed-{device}.md", f"Codec throughput ({device})", body)
    return {"json": json_path, "markdown": md_path}
