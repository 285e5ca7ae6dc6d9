"""The optimizer on the host under TRL's SFTTrainer and Accelerate, with clipping, gradient
accumulation, a cosine schedule with warm-up and weight decay on matrices, on the tiny Llama of
the targets (hidden 256, 4 layers, 4/2 heads, MLP 688, vocabulary 32000): checked against the
same runs without superneurons, on one process and on 2 gloo ranks; and what clipping costs
the 8B plan.

Each run is ``tests/host_step_run.py --model full`` (the test suite runs the same script on a
narrower model): TRL ``SFTTrainer`` with ``max_grad_norm=1.0``, ``gradient_accumulation_steps=2``,
``lr_scheduler_type="cosine"``, ``warmup_steps=1``, ``weight_decay=0.1`` (Trainer's groups:
no decay on biases and norms), ``optim="adamw_torch_fused"``, 5 steps of 2 micro-batches of 4,
with and without ``SuperNeuronsCallback(budget_fraction=1.0,
strategy="offload+host-optimizer")``, and the callback's run stopped at step 3 and resumed from
its checkpoint; the same through an Accelerate loop on the same Llama and texts (``accumulate``
over 2 micro-batches, ``clip_grad_norm_`` to 1.0, a cosine schedule with warm-up, weight decay
on matrices only) with and without ``prepare_superneurons``, stopped at step 3 and resumed. Then
``superneurons plan --model hf:llama-3-8b --seq-len 8192 --dtype bf16 --optimizer adamw``
with and without ``--max-grad-norm 1.0``.

    .venv/bin/python benchmarks/trainer_host_optimizer.py [--out DIR] [--skip-plan]

(``DIR``: ``benchmarks/results/trainer_host_optimizer`` by default.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from superneurons.bench.artifacts import markdown_table, write_json, write_markdown

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ("losses", "grad_norms", "params", "optimizer_state")
PLAN = ["--model", "hf:llama-3-8b", "--seq-len", "8192", "--dtype", "bf16", "--optimizer", "adamw"]
GIB = 2**30


def _runs(out: Path, ranks: int) -> list[dict[str, Any]]:
    """``tests/host_step_run.py --model full`` on ``ranks`` processes: each rank's record."""
    script = [str(ROOT / "tests" / "host_step_run.py"), "--out", str(out), "--model", "full"]
    if ranks == 1:
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                   str(ranks), "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
                   "--log-dir", str(out / "torchrun"), *script]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def _rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (rank, loop): whether the host run equals the plain one, and the resumed
    one the uninterrupted one, field by field."""
    rows = []
    for rank, record in enumerate(records):
        trl, acc = record["trl"], record["accelerate"]
        rows.append({
            "ranks": len(records), "rank": rank, "loop": "TRL SFTTrainer",
            **{f"{k} =": trl["host"][k] == trl["eager"][k] for k in RECORDED},
            "resumed =": all(trl["resumed"][k] == trl["host"][k] for k in RECORDED),
            "grad_norm (first, last)": _ends(trl["host"]["grad_norms"]),
            "host / eager s": _ratio(
                trl["host"]["train_runtime_s"], trl["eager"]["train_runtime_s"]
            ),
        })  # fmt: skip
        host, eager, resumed = acc["host"], acc["eager"], acc["resumed"]
        rows.append({
            "ranks": len(records), "rank": rank, "loop": "Accelerate",
            "losses =": host["losses"] == eager["losses"],
            "grad_norms =": host["norms"] == eager["norms"],
            "params =": host["params"] == eager["params"],
            "optimizer_state =": host["optimizer_state"] == eager["optimizer_state"],
            "resumed =": resumed["params"] == host["params"]
            and resumed["optimizer_state"] == host["optimizer_state"]
            and resumed["norms"] == host["norms"][-len(resumed["norms"]):],
            "grad_norm (first, last)": _ends(host["norms"]),
        })  # fmt: skip
    return rows


def _ends(values: list[float]) -> str:
    return f"{values[0]:.4f}, {values[-1]:.4f}" if values else ""


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def _plan_rows(out: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each strategy's 8B floor without and with ``--max-grad-norm 1.0``, and the costs."""
    found = {}
    for name, extra in (("plain", []), ("clipped", ["--max-grad-norm", "1.0"])):
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "superneurons.cli", "plan", *PLAN, *extra, "--json"],
            cwd=ROOT, check=True, capture_output=True, text=True,
        )  # fmt: skip
        found[name] = json.loads(done.stdout)
        found[name + "_wall_s"] = time.perf_counter() - start
        # the record without the plan's per-tensor decisions (the floors are what is compared)
        kept = {k: v for k, v in found[name].items() if k != "plan"}
        (out / f"plan_{name}.json").write_text(json.dumps(kept, indent=1) + "\n")
    plain, clipped = found["plain"], found["clipped"]
    rows = []
    for strategy, floor in plain["strategies"].items():
        other, cost = clipped["strategies"][strategy], clipped["step_costs"][strategy]
        rows.append({
            "strategy": strategy,
            "floor GiB": floor["min_budget_bytes"] / GIB,
            "clipped floor GiB": other["min_budget_bytes"] / GIB,
            "device GiB": cost["device_bytes"] / GIB,
            "host GiB": cost["host_bytes"] / GIB,
            "overhead s": cost["overhead_s"],
        })  # fmt: skip
    return rows, found


def _step_cpu_s(host: bool, clip: bool, steps: int = 8) -> float:
    """Median process CPU seconds of one training step of the tiny Llama (batch 4 x 64, fp32,
    fused AdamW), eager or under a host-optimizer plan, with or without clipping to 1.0: CPU
    time, so that other work on the machine does not enter. On a CPU the host steps inline
    either way, so this is what clipping adds to the work (a norm and a scaling pass), not the
    overlap with backward a GPU would lose (the plan's prediction above)."""
    import statistics

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from superneurons.memory import TrainingStep, apply_plan, make_plan, profile_step

    sys.path.insert(0, str(ROOT / "tests"))
    import trl_support

    torch.manual_seed(0)
    config = LlamaConfig(**trl_support.FULL, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 32000, (4, 64), generator=torch.Generator().manual_seed(0))

    def factory(params: list[Any]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)

    def loss_fn(out: Any, _target: Any) -> Any:
        return out.loss

    opt = factory(list(model.parameters()))
    handle, loop = None, opt
    if host:
        profile = profile_step(model, {"input_ids": ids, "labels": ids}, None, loss_fn, opt)
        plan = make_plan(
            profile, budget_bytes=1 << 40, strategy="offload+host-optimizer",
            step=TrainingStep(max_grad_norm=1.0) if clip else None,
        )  # fmt: skip
        handle = apply_plan(model, plan, optimizer_factory=factory)
        loop = handle.optimizer
    times = []
    for _ in range(steps):
        start = time.process_time()
        loop.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        if clip:
            if host:
                loop.clip_grad_norm_(1.0)
            else:
                from superneurons.memory.offload.host_grads import clip_grad_norm_

                clip_grad_norm_(model.parameters(), 1.0)
        loop.step()
        times.append(time.process_time() - start)
    if handle is not None:
        handle.remove()
    return statistics.median(times[2:])


def _timing_rows(rounds: int = 3) -> list[dict[str, Any]]:
    """Each configuration's step CPU time, the least over ``rounds`` interleaved rounds (the
    machine's other work shifts all of them alike within a round)."""
    import torch

    torch.set_num_threads(1)
    configs = [(host, clip) for host in (False, True) for clip in (False, True)]
    best = dict.fromkeys(configs, float("inf"))
    for _ in range(rounds):
        for config in configs:
            best[config] = min(best[config], _step_cpu_s(*config))
    rows = []
    for host in (False, True):
        plain, clipped = best[(host, False)], best[(host, True)]
        rows.append({
            "optimizer": "host (offload+host-optimizer)" if host else "device (eager)",
            "step CPU s": plain, "clipped step CPU s": clipped, "clipped / plain": clipped / plain,
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/trainer_host_optimizer"
    )
    parser.add_argument("--skip-plan", action="store_true", help="only the training runs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows, raw = [], {}
    for ranks in (1, 2):
        with tempfile.TemporaryDirectory(prefix="sn-host-step-") as tmp:
            start = time.perf_counter()
            records = _runs(Path(tmp), ranks)
            raw[f"ranks{ranks}"] = {"records": records, "wall_s": time.perf_counter() - start}
            rows += _rows(records)
    body = "## The same runs with and without the optimizer on the host (bitwise: `True`)\n\n"
    columns = ["ranks", "rank", "loop", *(f"{k} =" for k in RECORDED), "resumed =",
               "grad_norm (first, last)", "host / eager s"]  # fmt: skip
    body += markdown_table(rows, columns)
    timing = _timing_rows()
    body += (
        "\n## One training step's process CPU time, with and without clipping (tiny Llama, "
        "batch 4 x 64, one thread; per configuration the least of 3 interleaved rounds' "
        "medians of 6 steps after 2 warm-up steps)\n\n"
    )
    body += markdown_table(timing, list(timing[0]), floatfmt=".4g")
    body += (
        "\nThe device pair differs by two passes over the gradients (a norm, a scaling): its "
        "ratio is mostly this run's noise on a shared CPU. On the host the clipped step also "
        "keeps every gradient in host buffers until the step instead of one bucket at a time. "
        "A GPU's loss of overlap is not measured here: the plan below predicts it.\n"
    )
    plan_rows: list[dict[str, Any]] = []
    if not args.skip_plan:
        plan_rows, plans = _plan_rows(args.out)
        raw["plan_wall_s"] = {k: v for k, v in plans.items() if k.endswith("_wall_s")}
        body += (
            "\n## `plan --model hf:llama-3-8b --seq-len 8192 --dtype bf16 --optimizer adamw`, "
            "without and with `--max-grad-norm 1.0`\n\n"
        )
        body += markdown_table(plan_rows, list(plan_rows[0]), floatfmt=".4g")
    body += (
        "\nOne thread per process, on a CPU shared with other work: the runtimes (host / eager) "
        "describe this run only. Both runs of each pair are the same arithmetic: PyTorch's "
        "fused CPU AdamW steps the fp32 parameters on the device and their fp32 masters on the "
        "host alike; clipping is `clip_grad_norm_`'s, op for op, on the same gradients.\n"
    )
    write_json(args.out / "results.json", rows, plan=plan_rows, timing=timing, raw=raw)
    write_markdown(args.out / "results.md", "The optimizer on the host under Trainer", body)
    print(body)


if __name__ == "__main__":
    main()
