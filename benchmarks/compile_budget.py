"""The budget under ``torch.compile``: a tiny Llama (CPU, AdamW), measured in the c10 allocator's
view (:func:`superneurons.bench.memory.meter.allocator_peak_bytes`, which sees what inductor's
generated code allocates).

For fp32 parameters, fp32 under autocast-bf16 and bf16 parameters; the plain loop and HF's
``no_trainer`` loop (``outputs`` kept until the next step replaces them); recompute plans at 60%
and 45% of eager's predicted peak and at the reported minimum (the recompute floor): what
``apply_plan``'s default does with a compiled call (refused, the error recorded), and with
``compile="trace"`` the compiled step's measured peak against the budget and the plan's (eager)
prediction, and how far the parameters after the steps are from eager's. Beside it, in the same
run: eager's measured peak and the compiled step without a plan (its distance from eager is the
eager-vs-compile tolerance).

    PYTHONPATH=src .venv/bin/python benchmarks/compile_budget.py \
        [--out benchmarks/results/compile] [--modes fp32,autocast,bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from superneurons.bench.artifacts import markdown_table, write_json, write_markdown
from superneurons.bench.memory.meter import allocator_peak_bytes
from superneurons.errors import ConfigError
from superneurons.memory import apply_plan, make_plan
from superneurons.memory.plan import InfeasibleBudgetError, Plan
from superneurons.memory.planner.decide import strategy_floors
from superneurons.memory.profiling.step import output_loss, profile_step
from superneurons.memory.runtime.compiled import refusal_message

VOCAB, SEQ, BATCH, STEPS = 512, 128, 4, 4  # as tests/test_memory_budget_matrix.py
IDS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _llama(mode: str) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=172, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    return model.to(torch.bfloat16) if mode == "bf16" else model


class Loop:
    """The training loop users write; ``call`` is the model or its compiled wrapper."""

    def __init__(self, mode: str, kind: str) -> None:
        self.model = _llama(mode)
        self.call: Any = self.model
        self.mode, self.kind = mode, kind
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.batch = {"input_ids": IDS, "labels": IDS}
        self.kept: Any = None
        self.count = 0

    def step(self) -> None:
        torch.manual_seed(self.count)
        self.count += 1
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
        with autocast if self.mode == "autocast" else contextlib.nullcontext():
            outputs = self.call(**self.batch)
            loss = outputs.loss
        if self.kind == "no_trainer":
            self.kept = outputs
        del outputs
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def resident(self) -> list[torch.Tensor]:
        state = [t for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t)]
        kept = [v for v in self.kept.values() if torch.is_tensor(v)] if self.kept else []
        return [*self.model.parameters(), *self.model.buffers(), *state, IDS, *kept]


def _compiled_run(mode: str, kind: str, plan: Plan | None) -> dict[str, Any]:
    """Warm-up step eagerly, then the plan (if any) with compile='trace' and the compiled
    model: one step compiles, one more, then the meter's two."""
    loop = Loop(mode, kind)
    loop.step()
    torch._dynamo.reset()
    handle = apply_plan(loop.model, plan, compile="trace") if plan else contextlib.nullcontext()
    with handle:
        loop.call = torch.compile(loop.model)
        start = time.perf_counter()
        loop.step()
        compile_s = time.perf_counter() - start
        loop.step()
        peak = allocator_peak_bytes(loop.step, resident=loop.resident)
    twin = Loop(mode, kind)
    for _ in range(loop.count):
        twin.step()
    diff = max(
        (a.float() - b.float()).abs().max().item()
        for a, b in zip(twin.model.parameters(), loop.model.parameters(), strict=True)
    )
    return {"measured_compiled_bytes": peak, "compile_s": compile_s, "max_abs_diff_vs_eager": diff}


def _refused(mode: str, kind: str, plan: Plan) -> str:
    """What ``apply_plan``'s default does with a compiled call (the error's first words)."""
    loop = Loop(mode, kind)
    torch._dynamo.reset()
    with apply_plan(loop.model, plan):
        loop.call = torch.compile(loop.model)
        try:
            loop.step()
        except ConfigError as exc:
            exact = str(exc) == refusal_message("model")
            return "refused: ConfigError(refusal_message('model'))" if exact else str(exc)
    return "not refused"


def _case(mode: str, kind: str) -> list[dict[str, Any]]:
    loop = Loop(mode, kind)
    loop.step()
    keep = kind == "no_trainer"
    profile = profile_step(
        loop.model, loop.batch, None, output_loss, loop.opt, keep_output=keep,
        carry_output=keep, autocast=torch.bfloat16 if mode == "autocast" else None,
    )  # fmt: skip
    eager = profile.predicted_peak_bytes()
    measured_eager = allocator_peak_bytes(loop.step, resident=loop.resident)
    floor = strategy_floors(profile)["recompute"].min_budget_bytes
    base = {"mode": mode, "kind": kind, "eager_predicted_bytes": eager}
    rows = [{**base, "budget": "eager", "measured_eager_bytes": measured_eager}]
    rows.append({**base, "budget": "compile, no plan", **_compiled_run(mode, kind, None)})
    print(json.dumps(rows[-2:]), flush=True)
    for label, budget in (("60%", int(0.60 * eager)), ("45%", int(0.45 * eager)), ("min", floor)):
        row: dict[str, Any] = {**base, "budget": label, "budget_bytes": budget}
        try:
            plan = make_plan(profile, budget_bytes=budget, strategy="recompute")
        except InfeasibleBudgetError:
            row["skipped"] = f"below the recompute floor ({floor} B): make_plan refuses it"
            rows.append(row)
            continue
        row["predicted_bytes"] = plan.predicted_peak_bytes
        row["recompute_units"] = plan.count("recompute")
        row["default"] = _refused(mode, kind, plan)
        row.update(_compiled_run(mode, kind, plan))
        row["over_budget_bytes"] = row["measured_compiled_bytes"] - budget
        row["fits"] = row["over_budget_bytes"] <= 0
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/compile"))
    parser.add_argument("--modes", default="fp32,autocast,bf16")
    parser.add_argument("--kinds", default="plain,no_trainer")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with open("/proc/loadavg") as load:
        loadavg = load.read().split()[:3]
    rows = [
        row
        for mode in args.modes.split(",")
        for kind in args.kinds.split(",")
        for row in _case(mode, kind)
    ]
    with open("/proc/loadavg") as load:
        loadavg_end = load.read().split()[:3]
    write_json(
        args.out / "compile_budget.json",
        rows,
        loadavg_start=loadavg,
        loadavg_end=loadavg_end,
        command=" ".join(sys.argv),
    )
    columns = [
        "mode", "kind", "budget", "budget_bytes", "predicted_bytes", "measured_eager_bytes",
        "measured_compiled_bytes", "over_budget_bytes", "fits", "max_abs_diff_vs_eager",
        "compile_s", "default", "skipped",
    ]  # fmt: skip
    body = (
        "Tiny Llama (3 layers, hidden 64, vocab 512, B=4, T=128), AdamW, CPU; recompute plans "
        "made from the eager profile; `measured_compiled_bytes`: the c10 allocator's peak of a "
        "steady-state step of `torch.compile(model)` (inductor) under "
        "`apply_plan(model, plan, compile='trace')`; `default`: the same compiled call under "
        "`apply_plan(model, plan)`. `max_abs_diff_vs_eager`: parameters after the steps "
        "against the eager loop's; the compiled step without a plan gives the eager-vs-compile "
        f"tolerance. Load {' '.join(loadavg)} at the start, {' '.join(loadavg_end)} at the end, "
        "on 2 cores (`compile_s`: the first compiled step, inductor's cache warm or not).\n\n"
        + markdown_table(rows, columns)
    )
    write_markdown(args.out / "README.md", "The budget under torch.compile", body)


if __name__ == "__main__":
    main()
