"""Step time of dense DDP, PyTorch's fp16/PowerSGD hooks and our codecs over real links shaped
to a given bandwidth (network namespaces + tbf; needs root, or --no-shaping for loopback).

Example:
  superneurons bench network --bandwidth 100mbit,1gbit --nproc 2 --out benchmarks/results/network
  superneurons bench network --quick --no-shaping --out /tmp/net   # no root: loopback only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from superneurons.bench.links.netns import check_shaping_rate
from superneurons.bench.network.report import summary_lines, write_artifacts
from superneurons.bench.network.run import (
    ALL_CODECS,
    DEFAULT_MODELS,
    NetworkBenchConfig,
    add_breakdown,
    add_predictions,
    add_speedups,
    run_network_bench,
)
from superneurons.bench.network.scale import scale_lines
from superneurons.errors import ConfigError
from superneurons.rates import parse_rate

__all__ = ["HELP", "add_arguments", "run"]

HELP = "step time per codec over shaped network links (namespaces + tbf)"
_QUICK_CODECS = ("dense", "torch-fp16", "torch-powersgd:rank=4", "fft")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bandwidth",
        default="100mbit,1gbit",
        help="comma-separated link rates (tc syntax: 10mbit, 100mbit, 1gbit) or 'loopback' "
        "(unshaped, host namespace); default %(default)s",
    )
    parser.add_argument(
        "--nproc",
        default="2",
        help="ranks, one namespace each; a comma-separated list (2,4,8) measures every world "
        "size in turn (more than 2 ranks join a shaped bridge); default %(default)s",
    )
    parser.add_argument(
        "--predict-nproc",
        default="64,512",
        help="world sizes to predict from the measured ones: what auto would choose there and "
        "each codec's step time, from auto's recorded inputs and the fitted alpha-beta network "
        "carried to that size (needs 'auto' among --codecs); default %(default)s",
    )
    parser.add_argument(
        "--models",
        default=None,
        help=f"comma-separated subset of {','.join(DEFAULT_MODELS)} (default: all; --quick: fc-heavy)",
    )
    parser.add_argument(
        "--codecs",
        default=None,
        help=f"comma-separated codec specs (default: {','.join(ALL_CODECS)}; "
        f"--quick: {','.join(_QUICK_CODECS)})",
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 5, quick 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps (>= 2)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="launch the ranks N times per link and model, the codecs forwards, then backwards, "
        "and so on, and pool each codec's N x --steps timed steps into its record: on a shared "
        "machine drift then falls on every codec alike (default %(default)s)",
    )
    parser.add_argument(
        "--compute-steps", type=int, default=None, help="compute-only reference steps (2)"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument(
        "--data",
        choices=("real", "random"),
        default="real",
        help="what the ranks train on: real = Fashion-MNIST for the models that take it "
        "(fc-heavy, resnet; random batches, with a note, where the dataset is absent), "
        "random = noise images and labels (the old default); recorded per record "
        "as 'data' (default %(default)s)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer steps, codecs and models")
    parser.add_argument(
        "--no-shaping",
        action="store_true",
        help="run the ranks on loopback without namespaces (no root needed; measures codec "
        "cost, not a network)",
    )
    parser.add_argument(
        "--from-partial",
        action="store_true",
        help="measure nothing: write the artifacts from DIR/network.partial.jsonl, the records "
        "an interrupted run saved (give the same flags as that run)",
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")


def _config(args: argparse.Namespace) -> NetworkBenchConfig:
    model_names = (
        args.models.split(",") if args.models else (["fc-heavy"] if args.quick else DEFAULT_MODELS)
    )
    unknown = [m for m in model_names if m not in DEFAULT_MODELS]
    if unknown:
        raise ConfigError(f"unknown model(s) {unknown}: choose from {', '.join(DEFAULT_MODELS)}")
    codecs = (
        args.codecs.split(",") if args.codecs else (_QUICK_CODECS if args.quick else ALL_CODECS)
    )
    if args.no_shaping:
        bandwidths: tuple[int | None, ...] = (None,)
    else:
        bandwidths = tuple(
            None
            if text.strip().lower() == "loopback"
            else check_shaping_rate(parse_rate(text.strip()))
            for text in args.bandwidth.split(",")
            if text.strip()
        )
    steps = args.steps if args.steps is not None else (3 if args.quick else 5)
    return NetworkBenchConfig(
        bandwidths_bit_s=bandwidths,
        nprocs=parse_nprocs(args.nproc),
        predict_nprocs=parse_nprocs(args.predict_nproc),
        models={name: dict(DEFAULT_MODELS[name]) for name in model_names},
        codecs=tuple(c.strip() for c in codecs if c.strip()),
        batch_size=args.batch_size,
        warmup_steps=args.warmup,
        steps=steps,
        compute_steps=args.compute_steps if args.compute_steps is not None else 2,
        rounds=args.rounds,
        shaping=not args.no_shaping,
        data=args.data,
    )


def parse_nprocs(text: str) -> tuple[int, ...]:
    """``"2,4,8"`` -> ``(2, 4, 8)`` (a ConfigError that says what to write otherwise)."""
    try:
        values = tuple(int(part) for part in str(text).split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"--nproc takes world sizes such as 2 or 2,4,8, got {text!r}") from None
    if not values:
        raise ConfigError("--nproc needs at least one world size, e.g. --nproc 2")
    return values


def run(args: argparse.Namespace) -> int:
    config = _config(args)

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    partial = args.out / "network.partial.jsonl"
    if args.from_partial:
        if not partial.exists():
            raise ConfigError(f"{partial} not found: --from-partial needs an interrupted run's DIR")
        records = [json.loads(line) for line in partial.read_text().splitlines() if line]
        add_speedups(records)
        add_breakdown(records)
        add_predictions(records)
        note = (
            f"Interrupted run: these {len(records)} records were measured by the command in "
            f"{partial.name} before it was stopped; the artifacts were written afterwards by "
            "--from-partial."
        )
        paths = write_artifacts(records, args.out, config, note=note)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        partial.unlink(missing_ok=True)

        def save(record: dict[str, Any]) -> None:  # an interrupted run keeps what it measured
            with partial.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps({**record, "command": " ".join(sys.argv)}) + "\n")

        records = run_network_bench(config, progress=progress, on_record=save)
        paths = write_artifacts(records, args.out, config)
        partial.unlink(missing_ok=True)
    columns = (
        "bandwidth",
        "nproc",
        "model",
        "codec",
        "mean_step_s",
        "speedup_vs_dense",
        "bytes_per_step",
    )
    print("  ".join(f"{c:>22}" for c in columns))
    for record in records:
        cells = []
        for column in columns:
            value = record.get(column)
            cells.append(f"{value:>22.4g}" if isinstance(value, float) else f"{value!s:>22}")
        print("  ".join(cells))
    for line in summary_lines(records) + scale_lines(records, config.compressions):
        print(line)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if all(r.get("status") == "ok" for r in records) else 1
