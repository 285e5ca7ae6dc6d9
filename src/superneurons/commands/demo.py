"""Train a real model on local ranks twice — dense DDP, then superneurons (a memory budget plus
FFT gradient compression with error feedback) — and write DIR/report.md with plots.

Ranks: one per GPU (at most 2, NCCL) on a GPU machine, else 2 on CPU (gloo); --nproc N
chooses (more ranks than GPUs run on CPU, said in one line). The report names the device and
the torch version. Takes about 5 minutes on 2 CPU cores with the defaults; --limit-steps makes
it a smoke test.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from superneurons.demo import DemoConfig, run_demo

__all__ = ["HELP", "add_arguments", "run"]

HELP = "train dense vs superneurons on Fashion-MNIST and write a report (the main job)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DemoConfig()
    parser.add_argument("--out", type=Path, default=defaults.out_dir, help="output directory")
    parser.add_argument("--model", default=defaults.model, help="zoo model (trainer's table)")
    parser.add_argument("--data", default=defaults.data, help="fashion-mnist or shakespeare")
    parser.add_argument("--data-dir", default=None, help="dataset directory")
    parser.add_argument(
        "--nproc",
        type=int,
        default=defaults.nproc,
        help="local ranks (default: one per GPU, at most 2; else 2 on CPU)",
    )
    parser.add_argument(
        "--backend", default=defaults.backend, help="auto (default), nccl or gloo (CPU)"
    )
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="per rank")
    parser.add_argument("--compress", default=defaults.compress, help="codec spec for our run")
    parser.add_argument(
        "--budget-fraction",
        type=float,
        default=defaults.budget_fraction,
        help="memory budget as a fraction of eager's measured peak",
    )
    parser.add_argument("--limit-steps", type=int, default=None, help="steps per run (smoke test)")


def run(args: argparse.Namespace) -> int:
    config = DemoConfig(
        out_dir=args.out,
        model=args.model,
        data=args.data,
        data_dir=args.data_dir,
        nproc=args.nproc,
        backend=args.backend,
        epochs=args.epochs,
        batch_size=args.batch_size,
        compress=args.compress,
        budget_fraction=args.budget_fraction,
        limit_steps=args.limit_steps,
    )
    report = run_demo(config, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(f"report: {report}")
    return 0
