"""Going deeper: the deepest [6, 32, n, 6] ResNet and the largest ResNet-50/101/152 batch that fit
12 GiB per strategy (eager, checkpoint per block, cost-aware recompute, offload, offload with the
optimizer in backward), simulated on fake tensors; writes deeper.json/.md/.png to --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HELP = "deepest ResNet / largest batch per memory strategy in 12 GiB (fake tensors)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/deeper"))
    parser.add_argument(
        "--budget-fraction",
        type=float,
        default=0.95,
        help="fraction of 12 GiB usable for the depth search (default 0.95)",
    )
    parser.add_argument(
        "--no-validate",
        action="store_true",
        help="skip the direct profile that checks the extrapolation",
    )


def run(args: argparse.Namespace) -> int:
    from superneurons.bench.artifacts import markdown_table
    from superneurons.bench.memory.deeper import run_deeper

    torch.set_num_threads(1)
    records = run_deeper(
        args.out,
        budget_fraction=args.budget_fraction,
        validate=not args.no_validate,
        progress=lambda m: print(f"[deeper] {m}", file=sys.stderr, flush=True),
    )
    print(
        markdown_table(
            records,
            [
                "experiment",
                "model",
                "strategy",
                "max_depth",
                "max_batch",
                "vs_eager",
                "vs_anchor",
                "meets_target",
            ],
        )
    )
    print(f"wrote {args.out}/deeper.json, deeper.md, deeper.png")
    return 0
