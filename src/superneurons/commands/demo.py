"""Show why superneurons, measured in one run, and write DIR/report.md (figures from
DIR/demo.json): one step's memory eager vs planned; dense DDP vs superneurons (that memory
budget plus FFT gradient compression with error feedback), each trained for the same wall-clock
budget over the same emulated slow link (--rate; a network namespace per rank shaped with tc,
removed afterwards, also on Ctrl-C; loopback where that needs root or tc and is not there, said
in the report's first line), with test accuracy against time; and the language-model part (what
fits on a 24 and an 80 GiB card, TRL's SFTTrainer under a budget vs TRL's checkpointing).

Ranks: 2 gloo ranks over the shaped link; on loopback one per GPU (at most 2, NCCL) on a GPU
machine, else 2 on CPU (gloo); --nproc N chooses. 10 minutes measured on a quiet 2-core
machine (--quick: 3, smaller everywhere; longer on a busy one); --limit-steps makes it a smoke
test.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from superneurons.demo import DemoConfig, run_demo

__all__ = ["HELP", "add_arguments", "run"]

HELP = "dense vs superneurons over a slow link, memory, LMs: a report (the main job)"


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
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the same parts, smaller (9 minutes measured on a busy 2-core machine)",
    )
    parser.add_argument(
        "--rate", default=None, help="the emulated link's rate (default 10mbit), e.g. 50mbit"
    )
    parser.add_argument(
        "--no-shaping", action="store_true", help="train over loopback, no emulated link"
    )
    parser.add_argument(
        "--time-budget", type=float, default=None, help="seconds of training per arm"
    )
    parser.add_argument("--evals", type=int, default=None, help="test evaluations per arm")
    parser.add_argument("--eval-limit", type=int, default=None, help="test images per evaluation")
    parser.add_argument("--no-lm", action="store_true", help="leave out the language-model part")


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from superneurons.rates import parse_rate

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
        shaping=not args.no_shaping,
        lm=not args.no_lm,
    )
    if args.quick:
        config = config.as_quick()
    given = {
        "rate_bit_s": None if args.rate is None else parse_rate(args.rate),
        "time_budget_s": args.time_budget,
        "evals": args.evals,
        "eval_limit": args.eval_limit,
    }
    config = replace(config, **{k: v for k, v in given.items() if v is not None})
    report = run_demo(config, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(f"report: {report}")
    return 0
