"""Reproducible plans: the same model and batch planned again and again in one process.

A tiny Hugging Face Llama (hidden 256, 4 layers, 4/2 heads, MLP 688, vocabulary 2000, batch
4 x 256, fp32, AdamW, CPU, one thread) is profiled and planned ``--calls`` times by
``plan_for_batch`` at each budget fraction; each call measures the step's times afresh, so
timing noise reaches the planner every time. Recorded per fraction: how many distinct plans
(the per-unit actions) came out, how often each, and the wall time.

    .venv/bin/python benchmarks/plan_repeat.py [--calls 20] [--fractions 0.8,0.6,0.55]
        [--out benchmarks/results/plan_repeat]
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from pathlib import Path
from typing import Any

import torch

from superneurons.bench.artifacts import markdown_table, write_json, write_markdown


def _model_and_batch() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=688, vocab_size=2000, max_position_embeddings=256, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 2000, (4, 256), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def run(fraction: float, calls: int) -> dict[str, Any]:
    from superneurons.integrations.hf import plan_for_batch

    model, batch = _model_and_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    seen: collections.Counter[tuple[tuple[str, str], ...]] = collections.Counter()
    start_s = time.perf_counter()
    for _ in range(calls):
        plan = plan_for_batch(model, batch, optimizer=optimizer, budget_fraction=fraction)
        seen[tuple((u.fqn, u.action) for u in plan.units)] += 1
    plans = [
        {"count": count, "recompute": [fqn for fqn, action in key if action != "keep"]}
        for key, count in seen.most_common()
    ]
    return {
        "budget_fraction": fraction,
        "calls": calls,
        "distinct_plans": len(seen),
        "most_common_count": plans[0]["count"],
        "plans": plans,
        "wall_s": time.perf_counter() - start_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--fractions", default="0.8,0.6,0.55")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/plan_repeat"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()
    records = [run(float(f), args.calls) for f in args.fractions.split(",")]
    write_json(args.out / "plan_repeat.json", records, load=load)
    body = (
        f"`plan_for_batch` called {args.calls} times per budget fraction on the same model and "
        f"batch, in one process (1-min load at start {load[0]:.2f}).\n\n"
        + markdown_table(
            records, ["budget_fraction", "calls", "distinct_plans", "most_common_count", "wall_s"]
        )
        + "\n"
        + "\n".join(
            f"- {r['budget_fraction']}: "
            + "; ".join(f"{p['count']}x recompute {', '.join(p['recompute'])}" for p in r["plans"])
            for r in records
        )
        + "\n"
    )
    write_markdown(args.out / "plan_repeat.md", "Reproducible plans", body)


if __name__ == "__main__":
    main()
