"""The floor of the memory plans against eager and the largest-layer bound (fake tensors, bytes).

Targets: ResNet-50 batch 64, 224 px, SGD momentum, strategies DDP can use (no
optimizer-in-backward): floor <= 0.25 of eager; ``floor_over_largest_layer`` <= 1.25 for ResNet-50
and the zoo GPT-2 (batch 8, T 1024, AdamW). Each plan is also *executed* by the runtime
(``simulate_plan``: ``apply_plan`` on fake tensors, live storages counted), so the table shows
predicted and executed peaks side by side, at the floor and at 50% of eager.

Granularities: ``block`` (blocks + stem + head units) and ``auto`` (the blocks with the largest
working sets split into their layers). Bytes are device independent; no timing is measured.

    .venv/bin/python benchmarks/memory_floor.py [--out benchmarks/results/floor]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from superneurons.bench.artifacts import markdown_table, write_json, write_markdown
from superneurons.errors import ConfigError
from superneurons.memory.planner.bounds import largest_unit_bytes, resident_bytes, split_largest
from superneurons.memory.planner.decide import make_plan, min_peak_bytes
from superneurons.memory.profiling.step import profile_step
from superneurons.memory.sizing.simulate import OPTIMIZERS, simulate_plan
from superneurons.models.zoo import build_model, default_loss, model_input

CASES = [
    ("resnet50", 64, "sgd", {}),
    ("gpt", 8, "adamw", {"preset": "gpt2"}),
]
STRATEGY = "offload"  # DDP-safe: keep / offload / recompute / recompute+offload


def run(out: Path) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    rows = []
    for name, batch, optimizer, kwargs in CASES:
        model = build_model(name, **kwargs)
        opt = OPTIMIZERS[optimizer](model.parameters())
        x, y = model_input(name, batch, **kwargs)
        loss_fn = default_loss(name)
        block = profile_step(model, x, y, loss_fn, opt, fake=True)
        split = profile_step(
            model, x, y, loss_fn, opt, fake=True, units=split_largest(model, block)
        )
        for granularity, profile in (("block", block), ("auto", split)):
            eager = profile.predicted_peak_bytes()
            floor = min_peak_bytes(profile)[STRATEGY]
            bound = resident_bytes(profile) + largest_unit_bytes(profile)
            for label, budget in (("floor", floor), ("50%", eager // 2)):
                row: dict[str, Any] = {
                    "model": name,
                    "batch": batch,
                    "granularity": granularity,
                    "units": len(profile.units),
                    "budget": label,
                    "eager_gib": eager / 2**30,
                    "floor_over_eager": floor / eager,
                    "floor_over_largest_layer": floor / bound,
                    "resident_gib": resident_bytes(profile) / 2**30,
                    "largest_unit_gib": largest_unit_bytes(profile) / 2**30,
                }
                try:
                    plan = make_plan(profile, budget_bytes=budget, strategy=STRATEGY)
                except ConfigError:
                    rows.append({**row, "feasible": False})
                    continue
                executed = simulate_plan(model, x, y, loss_fn, opt, plan).measured_peak_bytes
                rows.append(
                    {
                        **row,
                        "feasible": True,
                        "predicted_gib": plan.predicted_peak_bytes / 2**30,
                        "executed_gib": executed / 2**30,
                        "executed_over_eager": executed / eager,
                        "executed_over_largest_layer": executed / bound,
                        "predicted_over_executed": plan.predicted_peak_bytes / executed - 1,
                        "executed_within_budget": executed <= budget,
                        "joint_units": plan.count("recompute+offload"),
                        "host_gib": plan.host_bytes / 2**30,
                    }
                )
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "floor.json", rows, strategy=STRATEGY)
    columns = [
        "model",
        "granularity",
        "units",
        "budget",
        "eager_gib",
        "floor_over_eager",
        "floor_over_largest_layer",
        "predicted_gib",
        "executed_gib",
        "executed_over_eager",
        "executed_over_largest_layer",
        "predicted_over_executed",
        "executed_within_budget",
        "joint_units",
        "host_gib",
    ]
    body = (
        f"Strategy `{STRATEGY}` (DDP-safe), fake tensors, fp32. Executed = the plan run by "
        "`apply_plan` on fake tensors (`simulate_plan`), live storages counted.\n\n"
        + markdown_table(rows, columns)
    )
    write_markdown(out / "floor.md", "Memory floor vs eager and the largest-layer bound", body)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/floor"))
    for record in run(parser.parse_args().out):
        print(record)
