"""Codec benchmark on real gradients (Wang et al., HPDC'20's central claim, tested).

Trains a ResNet-style CNN and an FC-heavy AlexNet on Fashion-MNIST, a char GPT and a char
LSTM on Shakespeare, and two transformers models we did not tune (GPT-2 on Shakespeare,
ResNet-18 on Fashion-MNIST), captures their gradients (cached under --cache), and measures
every codec at equal wire budgets of ~0.5, 1, 2 and 4 bits per element, the sparsifiers with
equal coding: relative error, cosine, error after K steps of error feedback, encode/decode GB/s
on one thread. Writes DIR/codecs.json, DIR/codecs.md and DIR/codecs.png.

With ``--device cpu|cuda`` it measures throughput instead: encode/decode GB/s of every codec at
4 MiB and 100 MiB on that device (CUDA timed with events), written to DIR/speed-<device>.json
and .md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from superneurons.bench.codecs.budgets import CodecBenchConfig, run_codec_bench
from superneurons.bench.codecs.gradients import CAPTURE_MODELS, CaptureConfig, load_or_capture
from superneurons.bench.codecs.report import write_codec_artifacts
from superneurons.bench.codecs.speed import (
    SPEED_SPECS,
    SpeedConfig,
    measure_codec_speed,
    write_speed_artifacts,
)
from superneurons.errors import ConfigError

HELP = "codec error / bits / speed on real gradients at equal bit budgets"

# --quick: 7 small-batch steps per model, the first 2^17 elements (512 KiB) of each gradient;
# measured ~14 s CPU, 35 s to 1 min 41 s wall (cold cache) with the four zoo models on the
# shared 2-core machine; the two HF models (transformers import, ResNet-18) add about a minute.
_QUICK_CAPTURE = CaptureConfig(steps=(0, 5), window=2, batch_size=16)
_QUICK_BENCH = CodecBenchConfig(timing_repeats=2, max_numel=2**17)
_FULL_CAPTURE = CaptureConfig(steps=(0, 100), window=20)
# Full: two capture points; error feedback over K = 20 consecutive step-100 gradients; each
# gradient sampled to its first 2**21 elements (8 MiB: two 4 MiB buckets) to keep the run
# within ~15 min on the shared 2-core machine.
_FULL_BENCH = CodecBenchConfig(timing_repeats=3, ef_window=20, max_numel=2**21)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small and fast (< 2 min)")
    parser.add_argument("--out", type=Path, default=Path("out/bench/codecs"), help="output dir")
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path("out/gradients"),
        help="captured-gradient cache directory (default: out/gradients)",
    )
    parser.add_argument(
        "--models",
        default=",".join(CAPTURE_MODELS),
        help=f"comma-separated subset of {','.join(CAPTURE_MODELS)}",
    )
    parser.add_argument(
        "--fashion-mnist-root", default="/usr/share/datasets/fashion-mnist", help="IDX files"
    )
    parser.add_argument("--shakespeare-root", default="data/shakespeare", help="*.txt files")
    parser.add_argument(
        "--device",
        default=None,
        help="measure throughput on this device (cpu, cuda) instead of errors on real gradients",
    )
    parser.add_argument(
        "--sizes-mib",
        default="4,100",
        help="with --device: comma-separated fp32 bucket sizes in MiB (default 4,100)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="with --device: timed repeats")
    parser.add_argument(
        "--codecs",
        default=None,
        help="with --device: comma-separated codec names/specs without ',' (default: all)",
    )


def run(args: argparse.Namespace) -> int:
    if args.device is not None:
        return _run_speed(args)
    from superneurons.train.progress import progress_bar

    torch.set_num_threads(1)
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    base = _QUICK_CAPTURE if args.quick else _FULL_CAPTURE
    capture_config = CaptureConfig(
        models=models,
        steps=base.steps,
        window=base.window,
        batch_size=base.batch_size,
        fashion_mnist_root=args.fashion_mnist_root,
        shakespeare_root=args.shakespeare_root,
    )
    bench_config = _QUICK_BENCH if args.quick else _FULL_BENCH
    start = time.perf_counter()
    steps_per_model = max(capture_config.steps) + capture_config.window
    captures = []
    with progress_bar(steps_per_model * len(models), desc="capture", file=sys.stderr) as bar:
        for model in models:
            captures.append(load_or_capture(model, capture_config, args.cache, progress=bar.update))
            bar.n = steps_per_model * len(captures)
            bar.refresh()
    with progress_bar(desc="codecs", file=sys.stderr, unit="setting") as bar:

        def progress(label: str) -> None:
            bar.set_postfix_str(label[:40])
            bar.update(1)

        records = run_codec_bench(captures, bench_config, progress=progress)
    if not records:
        raise ConfigError("codec benchmark produced no records")
    paths = write_codec_artifacts(
        records,
        args.out,
        quick=bool(args.quick),
        capture={
            "steps": capture_config.steps,
            "window": capture_config.window,
            "models": {
                c.model: {
                    "numel": c.numel,
                    "losses_at_steps": c.losses,
                    "train_s": c.train_s,
                    "recipe": str(CAPTURE_MODELS[c.model]),
                }
                for c in captures
            },
        },
        bench_config=str(bench_config),
        wall_s=time.perf_counter() - start,
    )
    _print_summary(records)
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def _print_summary(records: list[dict]) -> None:
    print(f"{'model':<8} {'budget':>6} {'spec':<52} {'bits/el':>8} {'rel_err':>8} "
          f"{'ef_err':>8} {'enc GB/s':>8} {'dec GB/s':>8}")  # fmt: skip
    for r in records:
        budget = "-" if r["budget_bits"] is None else f"{r['budget_bits']:g}"
        print(
            f"{r['model']:<8} {budget:>6} {r['spec'][:52]:<52} {r['bits_per_element']:>8.3f} "
            f"{r['rel_error']:>8.4f} {r['ef_rel_error']:>8.4f} {r['encode_gbps']:>8.3f} "
            f"{r['decode_gbps']:>8.3f}"
        )


def _run_speed(args: argparse.Namespace) -> int:
    try:
        sizes = tuple(float(x) for x in args.sizes_mib.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--sizes-mib must be numbers, got {args.sizes_mib!r}") from None
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here; use --device cpu")
    specs = SPEED_SPECS if args.codecs is None else tuple(args.codecs.split(","))
    config = SpeedConfig(device=args.device, sizes_mib=sizes, repeats=args.repeats, specs=specs)
    start = time.perf_counter()
    records = measure_codec_speed(config, progress=lambda label: print(label, file=sys.stderr))
    paths = write_speed_artifacts(
        records, args.out, config=str(config), wall_s=time.perf_counter() - start
    )
    print(f"{'MiB':>5} {'spec':<36} {'bits/el':>8} {'enc GB/s':>9} {'dec GB/s':>9}")
    for r in records:
        print(
            f"{r['size_mib']:>5g} {r['spec'][:36]:<36} {r['bits_per_element']:>8.3f} "
            f"{r['encode_gbps']:>9.3f} {r['decode_gbps']:>9.3f}"
        )
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0
