"""Final accuracy of every codec vs dense DDP, trained the same steps on Fashion-MNIST and on
character-level Shakespeare (2 gloo ranks on loopback, or over a shaped link with --bandwidth).

Example:
  superneurons bench convergence --out benchmarks/results/convergence
  superneurons bench convergence --quick --out /tmp/conv
  superneurons bench convergence --tasks shakespeare \
      --codecs dense,fft,adam-update[warmup=10]:signsgd --out /tmp/conv-lm
  superneurons bench convergence --tasks shakespeare --bandwidth 100mbit \
      --codecs "dense;auto;adam-momentum[warmup=20,wire=fp16]:signsgd" --out /tmp/conv-100m
  superneurons bench convergence --tasks shakespeare --nproc 4 --bandwidth 10mbit \
      --codecs "dense;diloco[steps=25]:fp16" --out /tmp/conv-diloco
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from superneurons.bench.convergence.config import ConvergenceConfig, TaskConfig
from superneurons.bench.convergence.report import summary_lines, write_artifacts
from superneurons.bench.convergence.run import run_convergence_bench
from superneurons.bench.links.netns import check_shaping_rate
from superneurons.errors import ConfigError
from superneurons.rates import parse_rate

__all__ = ["HELP", "add_arguments", "run"]

HELP = "final accuracy per codec vs dense on Fashion-MNIST and Shakespeare"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="3 codecs, 1 short epoch, 60 LM steps")
    parser.add_argument(
        "--codecs",
        default=None,
        help="codec labels separated by ',' or, when a label holds commas, by ';' "
        "(must include dense)",
    )
    parser.add_argument(
        "--tasks",
        default=None,
        help="comma-separated subset of fashion-mnist,shakespeare (default: both)",
    )
    parser.add_argument("--epochs", type=int, default=None, help="Fashion-MNIST epochs")
    parser.add_argument(
        "--model",
        choices=("mlp", "resnet"),
        default=None,
        help="Fashion-MNIST model: mlp (default) or resnet (the network benchmark's narrow "
        "ResNet-18 for 28x28x1 images)",
    )
    parser.add_argument(
        "--train-limit", type=int, default=None, help="Fashion-MNIST: first N training images"
    )
    parser.add_argument("--lm-steps", type=int, default=None, help="Shakespeare steps")
    parser.add_argument(
        "--eval-points", type=int, default=None, help="evaluations along each run (the curve)"
    )
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    parser.add_argument(
        "--nproc", type=int, default=2, help="gloo ranks (loopback, or namespaces with --bandwidth)"
    )
    parser.add_argument(
        "--fashion-mnist-root", default="/usr/share/datasets/fashion-mnist", help="IDX files"
    )
    parser.add_argument("--shakespeare-root", default="data/shakespeare", help="*.txt plays")
    parser.add_argument(
        "--bandwidth",
        default=None,
        help="run the ranks in network namespaces linked at this rate (e.g. 100mbit; needs "
        "root, as bench network); default: loopback",
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")


def _override(task: TaskConfig, args: argparse.Namespace) -> TaskConfig:
    if args.eval_points is not None:
        task = replace(task, eval_points=args.eval_points)
    if task.task == "fashion-mnist":
        if args.model == "resnet":
            from superneurons.bench.network.run import DEFAULT_MODELS

            task = replace(task, model="resnet", model_kwargs=dict(DEFAULT_MODELS["resnet"]))
        if args.epochs is not None:
            task = replace(task, epochs=args.epochs)
        if args.train_limit is not None:
            task = replace(task, train_limit=args.train_limit)
    elif args.lm_steps is not None:
        task = replace(task, steps=args.lm_steps)
    return task


def run(args: argparse.Namespace) -> int:
    config = ConvergenceConfig.quick() if args.quick else ConvergenceConfig()
    config = replace(
        config,
        nproc=args.nproc,
        seed=args.seed,
        fashion_mnist_root=args.fashion_mnist_root,
        shakespeare_root=args.shakespeare_root,
        bandwidth_bit_s=None
        if args.bandwidth is None
        else check_shaping_rate(parse_rate(args.bandwidth)),
    )
    if args.tasks:
        wanted = [t.strip() for t in args.tasks.split(",") if t.strip()]
        known = {t.task for t in config.tasks}
        unknown = sorted(set(wanted) - known)
        if unknown:
            raise ConfigError(f"unknown task(s) {unknown}; choose from {sorted(known)}")
        config = replace(config, tasks=tuple(t for t in config.tasks if t.task in wanted))
    config = replace(config, tasks=tuple(_override(t, args) for t in config.tasks))
    if args.codecs:
        sep = ";" if ";" in args.codecs else ","
        labels = tuple(c.strip() for c in args.codecs.split(sep) if c.strip())
        config = replace(config, codecs=labels)

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    records = run_convergence_bench(config, progress=progress)
    paths = write_artifacts(records, args.out, config)
    print(f"{'task':>14} {'codec':>40} {'metric':>18} {'final':>9} {'vs dense':>9} {'bytes':>7}")
    for r in records:
        delta = r["delta_vs_dense"]
        print(
            f"{r['task']:>14} {r['codec']:>40} {r['metric']:>18} {r['final_metric']:>9.3f} "
            f"{delta:>+9.3f} {r['ratio_vs_dense']:>6.1f}x"
        )
    for line in summary_lines(records, config):
        print(line)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
