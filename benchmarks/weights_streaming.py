"""Weights streamed from the host: what a full fine-tune's floor becomes, and what the link costs.

For each case, ``superneurons plan --model hf:NAME ... --json`` runs as a user runs it (a
subprocess, fake tensors: no weights are read, CUDA kernels modelled): bf16 parameters, AdamW with
fp32 masters on the host, batch 1. The record gives every strategy's floor; this benchmark reads
``offload+host-optimizer`` (all weights resident: the floor before streaming) and
``stream-weights`` (the units' weights in the host pool), the host bytes the streamed floor needs
and, for the streamed floor's plan, the predicted exposed copy time per step at PCIe 4.0 x16 and
PCIe 5.0 x16 (``--host-link``, ``memory.planner.cost.HOST_LINKS``) beside the step's compute
time from the same profile (``step_compute_s``: the cost model's roofline of the units' forward,
x3 for forward + backward, at the a100 preset's rates). Each model is planned for its card
(``--budget``: 6 GiB for the 8B, 20 GiB for the 70B) with ``--strategy auto``.

    .venv/bin/python benchmarks/weights_streaming.py [--cases llama-3-8b,llama-3.3-70b]
        [--out benchmarks/results/weights_streaming]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from superneurons.bench.artifacts import markdown_table, write_json, write_markdown

GIB = 2**30
# the model and the card each is planned for: the targets (8B on 6 GiB, 70B on 20 GiB)
CASES: dict[str, list[str]] = {
    "llama-3-8b": ["--model", "hf:llama-3-8b", "--seq-len", "8192", "--budget", "6GiB"],
    "llama-3.3-70b": ["--model", "hf:llama-3.3-70b", "--seq-len", "8192", "--budget", "20GiB"],
}
COMMON = ["--batch", "1", "--dtype", "bf16", "--optimizer", "adamw", "--strategy"]
LINKS = ("pcie4-x16", "pcie5-x16")


def _plan(args: list[str]) -> tuple[dict[str, Any], float, list[str]]:
    """``superneurons plan ... --json``: its record, its wall seconds and the command."""
    command = [sys.executable, "-m", "superneurons.cli", "plan", *args, "--json"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout), time.perf_counter() - start, command


def _case(name: str) -> dict[str, Any]:
    """One model on its card: the floors and the plan, at each link."""
    row: dict[str, Any] = {"case": name, "commands": []}
    for link in LINKS:
        record, wall_s, command = _plan([*CASES[name], *COMMON, "auto", "--host-link", link])
        row["commands"].append(" ".join(command[1:]))
        strategies = record["strategies"]
        row[f"exposed_s_{link}"] = record["exposed_transfer_s"]
        row[f"wall_s_{link}"] = wall_s
        row.update(
            budget_bytes=record["budget_bytes"],
            strategy=record["strategy"],
            resident_floor_bytes=strategies["offload+host-optimizer"]["min_budget_bytes"],
            streamed_floor_bytes=strategies["stream-weights"]["min_budget_bytes"],
            predicted_peak_bytes=record["predicted_peak_bytes"],
            pinned_host_bytes=record["pinned_host_bytes"],
            weights_host_bytes=record["weights_host_bytes"],
            streamed_bytes_per_step=record["streamed_bytes_per_step"],
            units_streamed=record["units_streamed"],
            compute_s=record["step_compute_s"],
        )
    return row


def _table(rows: list[dict[str, Any]]) -> str:
    shown = [
        {
            "model (T 8192, bf16, AdamW), budget": f"{r['case']}, {r['budget_bytes'] / GIB:.0f} GiB",
            "floor, weights resident": f"{r['resident_floor_bytes'] / GIB:.2f} GiB",
            "floor, weights streamed": f"{r['streamed_floor_bytes'] / GIB:.2f} GiB",
            "plan's peak": f"{r['predicted_peak_bytes'] / GIB:.2f} GiB",
            "units streamed": r["units_streamed"],
            "pinned host": f"{r['pinned_host_bytes'] / GIB:.1f} GiB",
            "weights on host": f"{r['weights_host_bytes'] / GIB:.1f} GiB",
            "streamed / step": f"{r['streamed_bytes_per_step'] / GIB:.1f} GiB",
            "exposed, PCIe 4.0": f"{r['exposed_s_pcie4-x16']:.2f} s",
            "exposed, PCIe 5.0": f"{r['exposed_s_pcie5-x16']:.2f} s",
            "compute / step": f"{r['compute_s']:.2f} s",
        }
        for r in rows
    ]
    return markdown_table(shown, list(shown[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out", default="benchmarks/results/weights_streaming")
    parser.add_argument(
        "--table-only", action="store_true", help="rewrite the Markdown table from the JSON"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.table_only:
        saved = json.loads((out / "weights_streaming.json").read_text(encoding="utf-8"))
        rows, command = saved["records"], saved["command"]
    else:
        rows = [_case(name) for name in args.cases.split(",")]
        command = " ".join([sys.executable, *sys.argv])
        write_json(out / "weights_streaming.json", rows, command=command)
    write_markdown(
        out / "weights_streaming.md",
        "Weights streamed from the host: floors and the link's cost (fake tensors)",
        f"Command: `{command}`\n\n{_table(rows)}\n"
        "Exposed: the plan's copies (activations, the optimizer's gradients and parameters, "
        "weights) and the host optimizer's step beyond the compute they overlap, per step, "
        "cost model; compute: 3x the units' forward at the a100 preset's fp32 roofline.\n",
    )


if __name__ == "__main__":
    main()
