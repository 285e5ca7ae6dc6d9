"""The longest context a QLoRA step fits, planned on fake tensors, beside Unsloth's published
maximum context lengths and HF + FA2's.

Unsloth's setup (their blog's tables): QLoRA r = 32 on all linear layers, nf4 base weights, bf16,
batch 1, Apple's Cut Cross-Entropy and offloaded gradient checkpointing; they publish, for
Llama-3.1-8B, 342k tokens on 80 GB (HF + FA2: 28k) and 2.9k on 8 GB (HF: OOM); for
Llama-3.3-70B, 89,389 on 80 GB (HF + FA2: 6,916) and 12,106 on 48 GB (HF: OOM).

Each row runs ``superneurons plan --max-seq-len`` as a user runs it (a subprocess, the exact
command recorded) with the same flags: ``--lora r=32,alpha=32,targets=all-linear --quantize nf4
--dtype bf16 --batch 1``, CUDA kernels modelled (flash attention, ``MatMul4Bit``'s dequantized
weights, foreach AdamW), outputs freed before backward as HF's ``Trainer`` does:

* superneurons: ``--strategy offload`` (per block recompute + offload of its checkpoint, the
  LM head + loss in chunks and block MLPs over sequence pieces; the optimizer on the device, as
  Unsloth's and HF's);
* HF + FA2, modelled: ``--strategy checkpoint --below off`` (every block checkpointed, its
  checkpoint kept on the device, the head whole): HF gradient checkpointing with flash
  attention.

Both search past the configuration's 131,072 positions (``--beyond-positions``: Unsloth's 342k
is past them too; ``max_seq_len`` stops at them, ``max_seq_len_memory`` is what memory allows)
and profile 4- and 8-layer copies extrapolated to the depth (``--fit-depth``). The fits are
then checked against direct full-depth profiles at the answer (``--validate``): the floor at
the answer and one quantum past it, its breakdown (what binds), and the fit's error there.

    .venv/bin/python benchmarks/adapters_max_context.py [--out DIR] [--quick] [--no-validate]
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
COMMON = [
    "--dtype", "bf16", "--batch", "1", "--lora", "r=32,alpha=32,targets=all-linear",
    "--quantize", "nf4", "--no-keep-outputs", "--device-preset", "h100",
]  # fmt: skip
SEARCH = ["--max-seq-len", "--beyond-positions", "--fit-depth", "--json"]
OURS = ["--strategy", "offload"]
HF_FA2 = ["--strategy", "checkpoint", "--below", "off"]
# Unsloth's published maximum context lengths (tokens) and HF + FA2's (None: OOM)
ANCHORS: list[dict[str, Any]] = [
    {"model": "llama-3.1-8b", "budget_gib": 80, "unsloth": 342_000, "hf_fa2_published": 28_000},
    {"model": "llama-3.1-8b", "budget_gib": 8, "unsloth": 2_900, "hf_fa2_published": None},
    {"model": "llama-3.3-70b", "budget_gib": 80, "unsloth": 89_389, "hf_fa2_published": 6_916},
    {"model": "llama-3.3-70b", "budget_gib": 48, "unsloth": 12_106, "hf_fa2_published": None},
]
VALIDATE = {("llama-3.1-8b", 80), ("llama-3.3-70b", 80), ("llama-3.3-70b", 48)}


def _command(model: str, budget_gib: int, strategy: list[str]) -> list[str]:
    return [
        "superneurons", "plan", "--model", f"hf:{model}", *COMMON, "--budget",
        f"{budget_gib}GiB", *strategy, *SEARCH,
    ]  # fmt: skip


def _search(command: list[str]) -> tuple[dict[str, Any], float]:
    """Run ``superneurons plan ... --max-seq-len --json``: its record and wall seconds."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "superneurons.cli", *command[1:]],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    record = json.loads(done.stdout)
    return (record[0] if isinstance(record, list) else record), time.perf_counter() - start


def _direct(model: str, strategy: str, below: str, seq_len: int) -> dict[str, Any]:
    """The strategy's floor at ``seq_len`` from a direct full-depth profile (no fit)."""
    from superneurons.memory.planner.cost import cost_model
    from superneurons.memory.planner.decide import describe_floors, search_floors
    from superneurons.memory.sizing.adapters import parse_lora, parse_quantize
    from superneurons.memory.sizing.llm import LMStep, load_config, profile_causal_lm_below
    from superneurons.memory.sizing.target import BELOW

    config, _ = load_config(model)
    step = LMStep(
        seq_len=seq_len, batch_size=1, dtype="bf16", keep_outputs=False,
        lora=parse_lora("r=32,alpha=32,targets=all-linear"), quantize=parse_quantize("nf4"),
    )  # fmt: skip
    start = time.perf_counter()
    plain, chunked = profile_causal_lm_below(
        config, step, variants=BELOW[below], check_positions=False
    )
    cost = cost_model("h100")
    floor = describe_floors(search_floors(plain, cost=cost, chunked=chunked))[strategy]
    return {
        "seq_len": seq_len,
        "floor_bytes": floor.min_budget_bytes,
        "peak_at": floor.peak_at,
        "breakdown_gib": {k: round(v / GIB, 3) for k, v in floor.breakdown.items() if v},
        "resident_gib": round(floor.resident_bytes / GIB, 3),
        "largest_unit_gib": round(floor.largest_unit_bytes / GIB, 3),
        "profile_wall_s": time.perf_counter() - start,
    }


def _fitted_bytes(record: dict[str, Any], seq_len: int) -> float:
    quantum = 256
    return float(record["intercept_bytes"] + record["slope_bytes"] * seq_len / quantum)


def _validate(row: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """Direct full-depth profiles at the answer and one quantum past it."""
    answer = ours["max_seq_len_memory"]
    at, past = (_direct(row["model"], "offload", "floor", n) for n in (answer, answer + 256))
    fitted = _fitted_bytes(ours, answer)
    budget = row["budget_gib"] * GIB
    return {
        "at_answer": at,
        "one_quantum_past": past,
        "fit_error_at_answer": fitted / at["floor_bytes"] - 1,
        "answer_fits_directly": at["floor_bytes"] <= budget,
        "next_fits_directly": past["floor_bytes"] <= budget,
    }


def _row(anchor: dict[str, Any], validate: bool) -> dict[str, Any]:
    model, budget_gib = anchor["model"], anchor["budget_gib"]
    ours_cmd, hf_cmd = (_command(model, budget_gib, s) for s in (OURS, HF_FA2))
    ours, ours_s = _search(ours_cmd)
    hf, hf_s = _search(hf_cmd)
    row: dict[str, Any] = {
        **anchor,
        "superneurons_memory": ours["max_seq_len_memory"],
        "superneurons_positions_capped": ours["max_seq_len"],
        "max_positions": ours["max_positions"],
        "hf_fa2_modelled_memory": hf["max_seq_len_memory"],
        "over_unsloth": ours["max_seq_len_memory"] / anchor["unsloth"],
        "beats_unsloth": ours["max_seq_len_memory"] >= anchor["unsloth"],
        "trainable_params": ours.get("trainable_params"),
        "fit_residual": ours["fit_residual"],
        "depth_fit_residual": ours["depth_fit_residual"],
        "hf_depth_fit_residual": hf["depth_fit_residual"],
        "superneurons_search_wall_s": ours_s,
        "hf_search_wall_s": hf_s,
        "superneurons_command": " ".join(ours_cmd),
        "hf_fa2_command": " ".join(hf_cmd),
        "superneurons_record": ours,
        "hf_fa2_record": hf,
        "floor_at_2048_gib": _fitted_bytes(ours, 2048) / GIB,
    }
    if validate and (model, budget_gib) in VALIDATE:
        row["validation"] = _validate(anchor, ours)
    print(json.dumps({k: v for k, v in row.items() if not k.endswith("_record")}), flush=True)
    return row


def _tokens(value: int | None) -> str:
    if value is None:
        return "OOM"
    if value == 0:
        return "0 (OOM)"
    return f"{value:,}"


def _markdown(rows: list[dict[str, Any]]) -> str:
    table = [
        {
            "model": r["model"],
            "budget": f"{r['budget_gib']} GiB",
            "Unsloth (published)": _tokens(r["unsloth"]),
            "HF + FA2 (published)": _tokens(r["hf_fa2_published"]),
            "superneurons plan": _tokens(r["superneurons_memory"]),
            "x Unsloth": f"{r['over_unsloth']:.2f}",
            "HF + FA2 (modelled)": _tokens(r["hf_fa2_modelled_memory"]),
            "fit residual": f"{r['fit_residual']:.2%}",
            "depth fit residual": f"{r['depth_fit_residual']:.3%}",
        }
        for r in rows
    ]
    body = (
        "Maximum context (tokens, batch 1) of a QLoRA step (nf4 base, LoRA r = 32 on all linear "
        "layers, bf16, AdamW), planned on fake tensors with CUDA's kernels modelled, beside "
        "Unsloth's published figures (their blog's tables) and HF + FA2's. The memory limit is "
        "reported past the models' 131,072 positions (`max_seq_len_memory`; `max_seq_len` "
        "stops at the positions, as Unsloth's 342k does not).\n\n"
        + markdown_table(table, list(table[0]))
        + "\n\nCommands (each row's exact `superneurons plan`):\n\n"
    )
    for r in rows:
        body += f"- `{r['superneurons_command']}`\n- `{r['hf_fa2_command']}`\n"
    checked = [r for r in rows if "validation" in r]
    if checked:
        body += "\nDirect full-depth profiles at the answer (no fit) and one quantum past it:\n\n"
        body += markdown_table(
            [
                {
                    "model": r["model"],
                    "budget": f"{r['budget_gib']} GiB",
                    "answer": r["superneurons_memory"],
                    "floor at answer (GiB)": r["validation"]["at_answer"]["floor_bytes"] / GIB,
                    "floor +256 (GiB)": r["validation"]["one_quantum_past"]["floor_bytes"] / GIB,
                    "fit error": f"{r['validation']['fit_error_at_answer']:.3%}",
                    "breakdown at answer (GiB)": r["validation"]["at_answer"]["breakdown_gib"],
                    "peak at": r["validation"]["at_answer"]["peak_at"],
                }
                for r in checked
            ],
            [
                "model", "budget", "answer", "floor at answer (GiB)", "floor +256 (GiB)",
                "fit error", "breakdown at answer (GiB)", "peak at",
            ],
        )  # fmt: skip
    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/adapters_max_context"))
    parser.add_argument("--quick", action="store_true", help="llama-3.1-8b only")
    parser.add_argument("--no-validate", action="store_true", help="no direct profiles")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with open("/proc/loadavg") as load:
        loadavg = load.read().split()[:3]
    anchors = ANCHORS[:2] if args.quick else ANCHORS
    rows = [_row(anchor, not args.no_validate) for anchor in anchors]
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "adapters_max_context.json", rows, loadavg=loadavg)
    write_markdown(
        args.out / "README.md",
        "Maximum context of a QLoRA step: Unsloth's anchors",
        _markdown(rows),
    )


if __name__ == "__main__":
    main()
