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

``--qlora CASES`` asks the QLoRA question instead: the longest sequence a step fits on a card
(``plan --max-seq-len --json``, QLoRA r 32 / alpha 64 on all linear layers over an nf4 base with
double quantisation, bf16, batch 1, outputs freed before backward as HF's ``Trainer`` does,
H100 kernels and rates modelled; past the configuration's 131,072 positions
(``--beyond-positions``: ``max_seq_len_memory`` is what memory allows) from 4- and 8-layer
copies extrapolated in depth (``--fit-depth``)), every strategy searched at once
(``--strategy auto``): ``stream-weights`` (the 4-bit weights and their quantization state in
the host pool) beside ``offload+host-optimizer`` and ``offload`` (weights resident). Each case
runs as its own process and is merged, by case, into ``qlora_max_seq_len.json`` with its own
command, machine and versions. ``--qlora-links CASES`` then plans the streamed step of a searched
case at its length, the whole depth directly, at each link: what the link costs there.

    .venv/bin/python benchmarks/weights_streaming.py [--cases llama-3-8b,llama-3.3-70b]
        [--out benchmarks/results/weights_streaming]
    .venv/bin/python benchmarks/weights_streaming.py --qlora llama-3.1-8b@80GiB
    .venv/bin/python benchmarks/weights_streaming.py --qlora-links llama-3.1-8b@80GiB
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

from superneurons.bench.artifacts import environment, markdown_table, write_json, write_markdown

GIB = 2**30
# the model and the card each is planned for: the targets (8B on 6 GiB, 70B on 20 GiB)
CASES: dict[str, list[str]] = {
    "llama-3-8b": ["--model", "hf:llama-3-8b", "--seq-len", "8192", "--budget", "6GiB"],
    "llama-3.3-70b": ["--model", "hf:llama-3.3-70b", "--seq-len", "8192", "--budget", "20GiB"],
}
COMMON = ["--batch", "1", "--dtype", "bf16", "--optimizer", "adamw", "--strategy"]
LINKS = ("pcie4-x16", "pcie5-x16")
# QLoRA: model@budget -> the context it should reach (tokens; 1: any at all; 70B on 80 GiB:
# Unsloth's published 89,389)
QLORA_CASES: dict[str, int] = {
    "llama-3.1-8b@80GiB": 500_000,
    "llama-3.1-8b@8GiB": 16_384,
    "llama-3.3-70b@80GiB": 89_389,
    "llama-3.3-70b@48GiB": 65_536,
    "llama-3.3-70b@24GiB": 1,
}
QLORA = [
    "--lora", "r=32,alpha=64,targets=all-linear", "--quantize", "nf4,double_quant=true",
    "--dtype", "bf16", "--batch", "1", "--no-keep-outputs", "--device-preset", "h100",
    "--strategy", "auto", "--max-seq-len", "--beyond-positions", "--fit-depth",
]  # fmt: skip
QLORA_STRATEGIES = ("stream-weights", "offload+host-optimizer", "offload")
QLORA_FILE = "qlora_max_seq_len"


def _plan(args: list[str]) -> tuple[dict[str, Any], float, list[str]]:
    """``superneurons plan ... --json``: its record (also where the budget fits no plan:
    ``feasible`` false), its wall seconds and the command."""
    command = [sys.executable, "-m", "superneurons.cli", "plan", *args, "--json"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall_s = time.perf_counter() - start
    # exit 2 with a record saying feasible: false: the budget fits no plan (the record says
    # what it would take); any other failure is one
    if done.returncode == 2 and done.stdout.strip():
        record = json.loads(done.stdout)
        if isinstance(record, dict) and record.get("feasible") is False:
            return record, wall_s, command
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout), wall_s, command


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


def _qlora_case(case: str) -> dict[str, Any]:
    """One model on one card: the longest sequence each strategy fits."""
    model, budget = case.split("@")
    records, wall_s, command = _plan(["--model", f"hf:{model}", "--budget", budget, *QLORA])
    by_strategy = {r["strategy"]: r for r in (records if isinstance(records, list) else [records])}
    first = next(iter(by_strategy.values()))
    row: dict[str, Any] = {
        "case": case,
        "model": model,
        "budget_bytes": first["budget_bytes"],
        "target_tokens": QLORA_CASES[case],
        "command": " ".join(["superneurons", *command[3:]]),
        "wall_s": wall_s,
        "environment": environment(),
        "depth_fit_residual": first.get("depth_fit_residual"),
    }
    for strategy in QLORA_STRATEGIES:
        found = by_strategy[strategy]
        row[strategy] = {
            "max_seq_len": found["max_seq_len"],
            "max_seq_len_memory": found.get("max_seq_len_memory", found["max_seq_len"]),
            "fit_residual": found["fit_residual"],
        }
    row["met"] = row["stream-weights"]["max_seq_len_memory"] >= row["target_tokens"]
    return row


def _qlora_table(rows: list[dict[str, Any]]) -> str:
    def tokens(row: dict[str, Any], strategy: str) -> str:
        return f"{row[strategy]['max_seq_len_memory']:,}"

    shown = [
        {
            "model, budget": f"{r['model']}, {r['budget_bytes'] / GIB:.0f} GiB",
            "target": f">= {r['target_tokens']:,}" if r["target_tokens"] > 1 else "> 0",
            "stream-weights": tokens(r, "stream-weights"),
            "offload+host-optimizer": tokens(r, "offload+host-optimizer"),
            "offload": tokens(r, "offload"),
            "met": "yes" if r["met"] else "no",
            "depth fit residual": f"{r['depth_fit_residual']:.2%}"
            if r["depth_fit_residual"] is not None
            else "",
            "wall": f"{r['wall_s'] / 60:.0f} min",
        }
        for r in rows
    ]
    return markdown_table(shown, list(shown[0]))


def _qlora_links(row: dict[str, Any]) -> dict[str, Any]:
    """The streamed plan at a row's longest sequence, one plan per link: what the link costs
    a step there (``plan --seq-len N --beyond-positions --strategy stream-weights``, the
    whole depth planned directly: no extrapolation)."""
    tokens = row["stream-weights"]["max_seq_len_memory"]
    flags = QLORA[: QLORA.index("--strategy")]
    args = ["--model", f"hf:{row['model']}", "--budget", row["case"].split("@")[1], *flags]
    args += ["--seq-len", str(tokens), "--beyond-positions", "--strategy", "stream-weights"]
    links: dict[str, Any] = {"seq_len": tokens}
    for link in LINKS:
        record, wall_s, command = _plan([*args, "--host-link", link])
        found = {"command": " ".join(["superneurons", *command[3:]]), "wall_s": wall_s}
        found["feasible"] = record["feasible"]
        found["compute_s"] = record["step_compute_s"]
        if record["feasible"]:
            for key in ("predicted_peak_bytes", "units_streamed", "streamed_bytes_per_step"):
                found[key] = record[key]
            found.update(exposed_s=record["exposed_transfer_s"])
            found.update(pinned_host_bytes=record["pinned_host_bytes"])
        else:  # the line through the shallow copies was a little short of the full depth
            found["min_budget_bytes"] = record["min_budget_bytes"]
        links[link] = found
    return links


def _qlora_links_table(rows: list[dict[str, Any]]) -> str:
    def exposed(row: dict[str, Any], link: str) -> str:
        found = row["links"][link]
        if not found["feasible"]:
            return f"does not fit ({found['min_budget_bytes'] / GIB:.2f} GiB)"
        return f"{found['exposed_s']:.2f} s"

    shown = []
    for r in rows:
        if "links" not in r:
            continue
        first = r["links"][LINKS[0]]
        shown.append(
            {
                "model, budget": f"{r['model']}, {r['budget_bytes'] / GIB:.0f} GiB",
                "tokens": f"{r['links']['seq_len']:,}",
                "plan's peak": f"{first['predicted_peak_bytes'] / GIB:.3f} GiB"
                if first["feasible"]
                else "",
                "units streamed": first["units_streamed"] if first["feasible"] else "",
                "streamed / step": f"{first['streamed_bytes_per_step'] / GIB:.1f} GiB"
                if first["feasible"]
                else "",
                "exposed, PCIe 4.0": exposed(r, "pcie4-x16"),
                "exposed, PCIe 5.0": exposed(r, "pcie5-x16"),
                "compute / step": f"{first['compute_s']:.1f} s",
            }
        )
    return markdown_table(shown, list(shown[0])) if shown else ""


def _write_qlora(out: Path, cases: list[str], links: list[str] | None = None) -> None:
    """Run ``cases`` (and the link plans of ``links``) and merge them by case into the saved
    records."""
    path = out / f"{QLORA_FILE}.json"
    saved = json.loads(path.read_text(encoding="utf-8"))["records"] if path.exists() else []
    rows = {r["case"]: r for r in saved}
    for case in cases:
        rows[case] = _qlora_case(case)
    for case in links or []:
        if case not in rows:
            raise SystemExit(f"--qlora-links {case}: no saved row; run --qlora {case} first")
        rows[case]["links"] = _qlora_links(rows[case])
    ordered = [rows[c] for c in QLORA_CASES if c in rows]
    links_table = _qlora_links_table(ordered)
    write_json(path, ordered, command="per record")
    write_markdown(
        out / f"{QLORA_FILE}.md",
        "QLoRA: the longest sequence a step fits, weights streamed or resident (fake tensors)",
        "Each row's command is in the JSON, with the machine and versions it ran on.\n\n"
        f"{_qlora_table(ordered)}\n"
        "Tokens: `max_seq_len_memory` (what memory allows, past the configurations' 131,072 "
        "positions), per strategy: `stream-weights` keeps the 4-bit weights and their "
        "quantization state in the host pool; the other two keep them on the device. QLoRA r 32, "
        "alpha 64, all linear layers, nf4 with double quantisation, bf16, batch 1, H100 kernels "
        "modelled; extrapolated in depth from 4- and 8-layer copies.\n"
        + (
            "\nWhat the link costs at the streamed length (`--qlora-links`): the streamed plan "
            "of the whole depth at that length, per step, at PCIe 4.0 x16 and PCIe 5.0 x16; "
            "exposed: copies no compute hides (cost model); compute: 3x the units' forward at "
            "the h100 preset's rates, each unit's time on the planner's quarter-octave grid "
            "(a step of 19%, so lengths within about 9% can show the same compute).\n\n"
            f"{links_table}\n"
            if links_table
            else ""
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out", default="benchmarks/results/weights_streaming")
    parser.add_argument(
        "--table-only", action="store_true", help="rewrite the Markdown table from the JSON"
    )
    parser.add_argument("--qlora", help=f"QLoRA cases, comma-separated: {', '.join(QLORA_CASES)}")
    parser.add_argument(
        "--qlora-links",
        help="QLoRA cases already searched: plan the streamed step at their length at each link",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.qlora or args.qlora_links:
        cases = args.qlora.split(",") if args.qlora else []
        links = args.qlora_links.split(",") if args.qlora_links else []
        unknown = sorted(set(cases + links) - set(QLORA_CASES))
        if unknown:
            parser.error(f"unknown QLoRA cases {unknown}: use {', '.join(QLORA_CASES)}")
        _write_qlora(out, cases, links)
        return
    if args.table_only:
        saved = json.loads((out / "weights_streaming.json").read_text(encoding="utf-8"))
        rows, command = saved["records"], saved["command"]
    else:  # each case merged, by case, into the saved records, with its own environment
        path = out / "weights_streaming.json"
        data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        saved = data.get("records", [])
        for row in saved:  # rows written before each kept its own: the file's
            row.setdefault("environment", data.get("environment"))
        merged = {r["case"]: r for r in saved}
        unknown = sorted(set(args.cases.split(",")) - set(CASES))
        if unknown:
            parser.error(f"unknown --cases {unknown}: use {', '.join(CASES)}")
        for name in args.cases.split(","):
            merged[name] = {**_case(name), "environment": environment()}
        rows = [merged[c] for c in CASES if c in merged]
        command = "per record"
        write_json(path, rows, command=command)
    write_markdown(
        out / "weights_streaming.md",
        "Weights streamed from the host: floors and the link's cost (fake tensors)",
        "Each row's commands are in the JSON, with the machine and versions it ran on.\n\n"
        f"{_table(rows)}\n"
        "Exposed: the plan's copies (activations, the optimizer's gradients and parameters, "
        "weights) and the host optimizer's step beyond the compute they overlap, per step, "
        "cost model; compute: 3x the units' forward at the a100 preset's fp32 roofline, each "
        "unit's time on the planner's quarter-octave grid (a step of 19%).\n",
    )


if __name__ == "__main__":
    main()
