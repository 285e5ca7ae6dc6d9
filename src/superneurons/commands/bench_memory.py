"""Device peak and step time of one training step: our plans at several budgets vs eager and the
anchors (checkpoint every unit, selective checkpointing, save_on_cpu, torch.compile's activation
memory budget), all in one run. Writes DIR/memory.json, DIR/memory.md and DIR/memory.png.

Budgets are percentages of eager's measured peak. ``--device cuda`` measures
``torch.cuda.max_memory_allocated`` and CUDA-event times; ``--device cpu`` a dispatch-level
live-storage count (what a GPU would hold) and CPU times with one thread.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from superneurons.errors import ConfigError

HELP = "peak memory and step time: our plans vs checkpointing, SAC, save_on_cpu, torch.compile"

logger = logging.getLogger("superneurons.bench")

# Full-size defaults per device (an H100 80GB on CUDA; a 2-core CPU on CPU).
_DEFAULT_BATCH = {
    ("resnet50", "cuda"): 64,
    ("resnet50", "cpu"): 32,
    ("gpt", "cuda"): 16,
    ("gpt", "cpu"): 16,
    ("gpt2", "cuda"): 8,
    ("gpt2", "cpu"): 2,
    ("hf-gpt2", "cuda"): 8,
    ("hf-gpt2", "cpu"): 2,
}

# --quick: the tiny models (--tiny) at a size where activations dominate the peak, so that the
# planner has something to trade at the default budgets (batch, image side or sequence length).
_QUICK_SIZE = {"resnet50": (32, 80), "gpt": (16, 128), "gpt2": (16, 128), "hf-gpt2": (16, 128)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="resnet50", choices=("resnet50", "gpt", "gpt2", "hf-gpt2")
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batch", type=int, default=None, help="batch size (default per model)")
    parser.add_argument(
        "--budgets", default="75,50,35,25", help="percent of eager's peak, comma separated"
    )
    parser.add_argument(
        "--image-size", type=int, default=None, help="image side (resnet50; cuda 224, cpu 112)"
    )
    parser.add_argument(
        "--block-size", type=int, default=None, help="sequence length (gpt 256, gpt2 1024)"
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps (cuda 20, cpu 3)")
    parser.add_argument(
        "--anchors",
        default=None,
        help="comma-separated anchors: checkpoint,selective,save_on_cpu,compile, 'all' or "
        "'none' (default: all on cuda; all but compile on cpu, where compiles take minutes)",
    )
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile points")
    parser.add_argument(
        "--compile-budgets",
        default="1,0.5,0.25,0.1,0",
        help="torch._functorch activation_memory_budget values the compile anchor sweeps",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="models at a tiny size (ResNet-50 at base width 16; GPT-2 at 2 layers of 64)",
    )
    parser.add_argument(
        "--optimizer-in-backward",
        action="store_true",
        help="let our plans step parameters in backward (the anchors cannot; DDP must not)",
    )
    parser.add_argument(
        "--cap-workspace",
        action="store_true",
        help="cuda: cap the allocator at the budget while our plans run (cuDNN workspaces get "
        "what the plan leaves; an over-budget tensor then fails with out-of-memory)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="--tiny models at a size where activations dominate (resnet50: batch 32 at 64 px; "
        "GPTs: batch 16, 128 tokens; --batch/--image-size/--block-size still apply), 1 step, "
        "no compile",
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="measure nothing: rewrite DIR/memory.md and memory.png from DIR/memory.json",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/memory"))


def _budgets(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) / 100.0 for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise ConfigError(f"--budgets takes percentages like 75,50,35,25, got {text!r}") from exc
    if not values:
        raise ConfigError("--budgets is empty: give percentages like 75,50,35,25")
    return values


def _fractions(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise ConfigError(f"--compile-budgets takes fractions like 1,0.5,0, got {text!r}") from exc


def _anchors(text: str | None, *, device: str, no_compile: bool) -> tuple[str, ...]:
    from superneurons.bench.memory.anchors import ANCHORS

    if text is None:
        chosen = ANCHORS if device == "cuda" else tuple(a for a in ANCHORS if a != "compile")
    elif text.strip() in ("all", "none"):
        chosen = ANCHORS if text.strip() == "all" else ()
    else:
        chosen = tuple(a.strip() for a in text.split(",") if a.strip())
        unknown = sorted(set(chosen) - set(ANCHORS))
        if unknown:
            raise ConfigError(f"--anchors: unknown {unknown}; choose from {', '.join(ANCHORS)}")
    return tuple(a for a in chosen if not (a == "compile" and no_compile))


def run(args: argparse.Namespace) -> int:
    import torch

    from superneurons.bench.artifacts import write_json, write_markdown
    from superneurons.bench.memory.report import plot, report_markdown, table_rows, verdicts
    from superneurons.bench.memory.run import MemoryBenchConfig, bench_context, run_memory_bench

    if args.render_only:
        return _render(args.out)
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    anchors = _anchors(args.anchors, device=args.device, no_compile=args.no_compile or args.quick)
    quick = args.quick
    if quick:
        batch, size = _QUICK_SIZE[args.model]
        image_size, block_size = args.image_size or size, args.block_size or size
    else:
        batch = _DEFAULT_BATCH[(args.model, args.device)]
        image_size = args.image_size or (224 if cuda else 112)
        block_size = args.block_size or (1024 if "gpt2" in args.model else 256)
    config = MemoryBenchConfig(
        model=args.model,
        device=args.device,
        batch_size=args.batch or batch,
        budgets=_budgets(args.budgets),
        compile_budgets=_fractions(args.compile_budgets),
        image_size=image_size,
        block_size=block_size,
        steps=1 if quick else args.steps or (20 if cuda else 3),
        methods=("eager", "ours", "ours-offload", *anchors),
        tiny=args.tiny or quick,
        optimizer_in_backward=args.optimizer_in_backward,
        cap_workspace=args.cap_workspace,
    )
    records = run_memory_bench(config)
    if "compile" not in anchors:
        records.append(
            {
                "model": args.model,
                "method": "compile",
                "budget_fraction": None,
                "peak_bytes": None,
                "skipped": "not run (--anchors / --no-compile / --quick, or the cpu default): "
                "inductor compiles of fwd+bwd take minutes per budget on a 2-core CPU",
            }
        )
    from superneurons.bench.artifacts import markdown_table
    from superneurons.bench.memory.report import COLUMNS

    print(markdown_table(table_rows(records), COLUMNS))
    found = verdicts(records)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(
        args.out / "memory.json", records, verdicts=found, load=_load(), **bench_context(config)
    )
    body = report_markdown(records, device=args.device, load=_load())
    write_markdown(args.out / "memory.md", f"Memory benchmark: {args.model} ({args.device})", body)
    plot(records, args.out / "memory.png", device=args.device)
    return 0


def _render(out: Path) -> int:
    """Rewrite the Markdown and the plot of an earlier run from its JSON (same measurements)."""
    import json

    from superneurons.bench.artifacts import write_markdown
    from superneurons.bench.memory.report import plot, report_markdown

    path = out / "memory.json"
    if not path.exists():
        raise ConfigError(f"--render-only: {path} does not exist; run the benchmark first")
    body = json.loads(path.read_text(encoding="utf-8"))
    records, device = body["records"], body["config"]["device"]
    env = body["environment"]
    measured = (
        f"Measured by `{env['command']}` at {env['time_utc']} (records in memory.json); this "
        "page was rendered from them.\n\n"
    )
    text = measured + report_markdown(records, device=device, load=body.get("load", "unknown"))
    write_markdown(out / "memory.md", f"Memory benchmark: {records[0]['model']} ({device})", text)
    plot(records, out / "memory.png", device=device)
    return 0


def _load() -> str:
    try:
        return "/".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:  # pragma: no cover - not on every platform
        return "unknown"
