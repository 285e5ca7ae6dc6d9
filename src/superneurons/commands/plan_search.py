"""``superneurons plan --max-depth / --max-batch / --max-seq-len``: the largest size that fits,
per strategy (:func:`superneurons.memory.sizing.search.largest_fitting`), printed."""

from __future__ import annotations

import json

from superneurons.commands.plan_target import PlanRequest, progress
from superneurons.memory.plan import SEARCH_STRATEGIES
from superneurons.memory.sizing.search import SEQ_QUANTUM, largest_fitting

__all__ = ["SEQ_QUANTUM", "run_search"]


def run_search(request: PlanRequest, *, as_json: bool) -> int:
    """``--max-depth`` / ``--max-batch`` / ``--max-seq-len``: the largest size per strategy."""
    assert request.search is not None
    strategies = SEARCH_STRATEGIES if request.strategy == "auto" else (request.strategy,)
    records = largest_fitting(
        request.target,
        request.search,
        budget_bytes=request.budget_bytes,
        strategies=strategies,
        cost=request.cost,
        progress=progress,
        lm=request.lm_search,
    )
    if as_json:
        print(json.dumps(records[0] if len(records) == 1 else records, indent=1))
        return 0
    key = f"max_{request.search}"
    for r in records:
        note = " (the configuration's positions)" if r.get("limited_by_positions") else ""
        if f"{key}_memory" in r:
            note += f"; memory allows {r[f'{key}_memory']}"
        print(
            f"{r['strategy']:<26} {key} {r[key]:>7}{note}   (fit residual {r['fit_residual']:.2%})"
        )
    if "depth_fit_residual" in records[0]:
        print(f"depth fit residual {records[0]['depth_fit_residual']:.2%}")
    return 0
