"""``superneurons plan --max-depth / --max-batch / --max-seq-len``: the largest size that fits,
per strategy (:func:`superneurons.memory.sizing.search.largest_fitting`), printed."""

from __future__ import annotations

import argparse
import json

from superneurons.commands.plan_target import progress
from superneurons.memory.plan import SEARCH_STRATEGIES
from superneurons.memory.planner.cost import CostModel
from superneurons.memory.sizing.search import SEQ_QUANTUM, largest_fitting
from superneurons.memory.sizing.target import Target

__all__ = ["SEQ_QUANTUM", "run_search"]


def run_search(args: argparse.Namespace, target: Target, budget_bytes: int, cost: CostModel) -> int:
    """``--max-depth`` / ``--max-batch`` / ``--max-seq-len``: the largest size per strategy."""
    axis = "depth" if args.max_depth else "seq_len" if args.max_seq_len else "batch"
    strategies = SEARCH_STRATEGIES if args.strategy == "auto" else (args.strategy,)
    records = largest_fitting(
        target, axis, budget_bytes=budget_bytes, strategies=strategies, cost=cost, progress=progress
    )
    if args.json:
        print(json.dumps(records[0] if len(records) == 1 else records, indent=1))
        return 0
    key = f"max_{axis}"
    for r in records:
        note = " (the configuration's positions)" if r.get("limited_by_positions") else ""
        print(
            f"{r['strategy']:<26} {key} {r[key]:>7}{note}   (fit residual {r['fit_residual']:.2%})"
        )
    return 0
