"""Device peak and step time of one training step: our plans at several budgets vs eager,
checkpoint-per-block, selective checkpointing, save_on_cpu and torch.compile's activation memory
budget. Writes DIR/memory.json, DIR/memory.md and DIR/memory.png.

Budgets are percentages of eager's measured peak. On a CPU build the peak is a dispatch-level
live-storage count with host memory (the pool's slab, save_on_cpu's copies) left out, i.e. what
a GPU would hold; step times are CPU times with one thread.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from superneurons.errors import ConfigError

HELP = "peak memory and step time: our plans vs checkpointing, save_on_cpu, torch.compile"

logger = logging.getLogger("superneurons.bench")

COLUMNS = (
    "model",
    "method",
    "budget_fraction",
    "peak_mib",
    "predicted_mib",
    "peak_fraction",
    "step_s",
    "step_ratio_vs_eager",
    "plan",
    "note",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="resnet50", choices=("resnet50", "gpt"))
    parser.add_argument("--batch", type=int, default=None, help="batch size (default per model)")
    parser.add_argument(
        "--budgets", default="100,50,25,10", help="percent of eager's peak, comma separated"
    )
    parser.add_argument("--image-size", type=int, default=112, help="image side (resnet50)")
    parser.add_argument("--block-size", type=int, default=256, help="sequence length (gpt)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per point (median)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile points")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 step, no compile")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/memory"))


def _budgets(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) / 100.0 for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise ConfigError(f"--budgets takes percentages like 100,50,25,10, got {text!r}") from exc
    if not values:
        raise ConfigError("--budgets is empty: give percentages like 100,50,25,10")
    return values


def run(args: argparse.Namespace) -> int:
    import torch

    from superneurons.bench.artifacts import markdown_table, write_json, write_markdown
    from superneurons.bench.memory import METHODS, MemoryBenchConfig, run_memory_bench

    torch.set_num_threads(1)
    methods = tuple(m for m in METHODS if not (m == "compile" and (args.no_compile or args.quick)))
    default_batch = {"resnet50": 32, "gpt": 16}[args.model]
    config = MemoryBenchConfig(
        model=args.model,
        batch_size=args.batch or (4 if args.quick else default_batch),
        budgets=_budgets(args.budgets),
        image_size=64 if args.quick else args.image_size,
        block_size=64 if args.quick else args.block_size,
        steps=1 if args.quick else args.steps,
        methods=methods,
    )
    records = run_memory_bench(config)
    if "compile" not in methods:
        reason = "--quick" if args.quick else "--no-compile"
        records.append(
            {
                "model": args.model,
                "method": "compile",
                "budget_fraction": None,
                "peak_bytes": None,
                "skipped": f"not run ({reason}): inductor compiles of fwd+bwd take minutes per "
                "budget on this 2-core machine",
            }
        )
    rows = [_row(r) for r in records]
    table = markdown_table(rows, COLUMNS)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "memory.json", records, config=config.__dict__)
    write_markdown(args.out / "memory.md", f"Memory benchmark: {args.model}", _report(rows, table))
    _plot(records, args.out / "memory.png")
    return 0


def _row(record: dict[str, Any]) -> dict[str, Any]:
    mib = 1024.0**2
    row = dict(record)
    if record.get("peak_bytes") is not None:
        row["peak_mib"] = record["peak_bytes"] / mib
    if record.get("predicted_peak_bytes"):
        row["predicted_mib"] = record["predicted_peak_bytes"] / mib
    if "actions" in record:
        actions = record["actions"]
        row["plan"] = f"k{actions['keep']}/o{actions['offload']}/r{actions['recompute']}" + (
            "+opt" if record.get("optimizer_in_backward") else ""
        )
    row["note"] = record.get("skipped") or record.get("peak_note") or ""
    return row


def _report(rows: list[dict[str, Any]], table: str) -> str:
    eager = next(r for r in rows if r["method"] == "eager")
    lines = [
        table,
        "",
        f"Eager: peak {eager['peak_mib']:.1f} MiB, {eager['step_s']:.3f} s/step. "
        "Peaks are dispatch-level live-storage counts of one steady-state step (host memory "
        "excluded: what a GPU would hold); times are medians of CPU steps with one thread.",
        "",
        f"NOTE: load average (1/5/15 min) at the end: {_load()}; on a shared machine step "
        "times are noisy (compare ratios measured in the same run). Peaks are exact (they "
        "do not depend on load).",
        "",
    ]
    ours = [r for r in rows if r["method"] == "ours" and r.get("peak_mib") is not None]
    ckpt = next((r for r in rows if r["method"] == "checkpoint"), None)
    for r in ours:
        if abs(r["budget_fraction"] - 0.5) < 1e-9:
            lines.append(
                f"At 50% of eager's peak: ours {r['peak_fraction']:.2f}x peak, "
                f"{r['step_ratio_vs_eager']:.2f}x eager step time (target <= 1.25x)"
                + (
                    f"; checkpoint-per-block {ckpt['peak_fraction']:.2f}x peak, "
                    f"{ckpt['step_ratio_vs_eager']:.2f}x step time."
                    if ckpt and ckpt.get("peak_mib") is not None
                    else "."
                )
            )
    return "\n".join(lines) + "\n"


def _load() -> str:
    try:
        return "/".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:  # pragma: no cover - not on every platform
        return "unknown"


def _plot(records: list[dict[str, Any]], path: Path) -> None:
    from superneurons.bench.artifacts import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    methods = sorted({r["method"] for r in records})
    for method in methods:
        points = [
            (r["peak_fraction"], r["step_ratio_vs_eager"])
            for r in records
            if r["method"] == method and r.get("peak_fraction") is not None
        ]
        if points:
            xs, ys = zip(*sorted(points), strict=True)
            ax.plot(xs, ys, marker="o", linestyle="-" if len(xs) > 1 else "", label=method)
    ax.axhline(1.25, color="grey", linestyle=":", linewidth=1, label="1.25x eager")
    ax.set_xlabel("device peak / eager peak")
    ax.set_ylabel("step time / eager step time")
    ax.set_title(f"{records[0]['model']}: peak vs step time (CPU, 1 thread)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
