"""Codec benchmark on real gradients (Wang et al., HPDC'20's central claim, tested).

Trains a ResNet-style CNN and an FC-heavy AlexNet on Fashion-MNIST and a char GPT and a char
LSTM on Shakespeare for a few hundred steps, captures their gradients at several points
(cached under --cache), and measures every codec at equal wire budgets of ~0.5, 1, 2 and 4
bits per element: relative error, cosine, error-feedback accumulation, encode/decode GB/s on
one thread. Writes DIR/codecs.json, DIR/codecs.md and DIR/codecs.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from superneurons.bench.codecs import CodecBenchConfig, run_codec_bench, write_codec_artifacts
from superneurons.bench.gradients import CAPTURE_MODELS, CaptureConfig, load_or_capture
from superneurons.errors import ConfigError

HELP = "codec error / bits / speed on real gradients at equal bit budgets"

# --quick: 7 small-batch steps per model, the first 2^17 elements (512 KiB) of each gradient;
# measured ~14 s CPU, 35 s to 1 min 41 s wall (cold cache) on the shared 2-core machine.
_QUICK_CAPTURE = CaptureConfig(steps=(0, 5), window=2, batch_size=16)
_QUICK_BENCH = CodecBenchConfig(timing_repeats=2, max_numel=2**17)
_FULL_CAPTURE = CaptureConfig(steps=(0, 50, 200), window=8)
# Full: every element, 3 capture points; error feedback over K = 4 consecutive step-200
# gradients (K = 8 doubled the run, ~55 min on the shared machine).
_FULL_BENCH = CodecBenchConfig(timing_repeats=3, ef_window=4)


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


def run(args: argparse.Namespace) -> int:
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
