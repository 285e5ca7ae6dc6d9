"""Mixed precision under a budget: predicted against measured, tiny HF Llama and GPT-2, CPU, AdamW.

Precisions: fp32 parameters; fp32 parameters under ``torch.autocast("cpu", torch.bfloat16)``
around forward + loss (backward and the step outside it); bf16 parameters; bf16 parameters with
fp32 master weights the optimizer keeps in its state (``MasterAdamW`` below). Loops: the plain
one (``model(**batch).loss.backward()``) and HF's ``no_trainer`` one (``outputs`` alive until the
next step). Budgets: 60% and 45% of eager's predicted peak and the reported minimum of strategy
``recompute`` (``plan_for_batch``'s ``auto`` on a CPU device). Measured: the c10 CPU allocator's
peak of one steady-state step (``bench.memory.meter.allocator_peak_bytes``); gradients after
the steps compared bit for bit with an eager twin. Under autocast, also the floor when the whole
``plan_for_batch`` call runs inside the user's autocast against ``autocast=torch.bfloat16``.

    .venv/bin/python benchmarks/mixed_precision.py [--out benchmarks/results/mixed_precision]
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

import torch
import transformers

from superneurons.bench.artifacts import markdown_table, write_json, write_markdown
from superneurons.bench.memory.meter import allocator_peak_bytes
from superneurons.errors import ConfigError
from superneurons.integrations.hf import plan_for_batch
from superneurons.memory import apply_plan, make_plan
from superneurons.memory.planner.decide import strategy_floors
from superneurons.memory.profiling.step import output_loss, profile_step

VOCAB, SEQ, BATCH = 512, 128, 4
IDS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
PRECISIONS = ("fp32", "autocast", "bf16", "bf16+fp32-masters")


class MasterAdamW(torch.optim.AdamW):
    """AdamW over fp32 master copies of bf16 parameters, kept in its own state (``master``):
    each step updates the master with the gradient in fp32 and writes it back rounded."""

    def step(self, closure: Any = None) -> Any:
        swapped = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                master = self.state[p].get("master", None)  # made at the first step
                master = p.detach().float() if master is None else master
                swapped.append((p, p.data, p.grad, master))
                p.data, p.grad = master, p.grad.float()
        try:
            return super().step(closure)
        finally:
            for p, low, grad, master in swapped:
                self.state[p]["master"] = master
                low.copy_(master)
                p.data, p.grad = low, grad


def _model(name: str, precision: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        model: torch.nn.Module = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                num_hidden_layers=3,
                hidden_size=64,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=172,
                vocab_size=VOCAB,
                max_position_embeddings=SEQ,
                use_cache=False,
            )  # fmt: skip
        )
    else:  # dropout on: a recompute replays the same masks
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                n_layer=3, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ, use_cache=False
            )
        )
    return model.to(torch.float32 if precision in ("fp32", "autocast") else torch.bfloat16)


class Loop:
    """One training loop as users write it; ``kept``: the ``no_trainer`` loop's ``outputs``."""

    def __init__(self, name: str, precision: str, kind: str) -> None:
        self.model = _model(name, precision).train()
        optimizer = MasterAdamW if precision == "bf16+fp32-masters" else torch.optim.AdamW
        self.opt = optimizer(self.model.parameters(), lr=1e-3)
        self.precision, self.kind, self.kept, self.count = precision, kind, None, 0

    def step(self) -> None:
        torch.manual_seed(self.count)  # the eager twin's dropout masks
        self.count += 1
        bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
        with bf16 if self.precision == "autocast" else contextlib.nullcontext():
            outputs = self.model(input_ids=IDS, labels=IDS)
            loss = outputs.loss
        self.kept = outputs if self.kind == "no_trainer" else None
        del outputs
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def resident(self) -> list[torch.Tensor]:
        state = [t for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t)]
        kept = [v for v in self.kept.values() if torch.is_tensor(v)] if self.kept else []
        return [*self.model.parameters(), *self.model.buffers(), *state, IDS, *kept]


def _case(name: str, precision: str, kind: str) -> list[dict[str, Any]]:
    loop = Loop(name, precision, kind)
    loop.step()  # the optimizer state exists, as in steady state
    keep = kind == "no_trainer"
    autocast = torch.bfloat16 if precision == "autocast" else None
    profile = profile_step(
        loop.model, {"input_ids": IDS, "labels": IDS}, None, output_loss, loop.opt,
        keep_output=keep, carry_output=keep, autocast=autocast,
    )  # fmt: skip
    eager = profile.predicted_peak_bytes()
    measured_eager = allocator_peak_bytes(loop.step, resident=loop.resident)
    floor = strategy_floors(profile)["recompute"].min_budget_bytes
    base = {"model": name, "precision": precision, "loop": kind}
    rows = [{**base, "budget": "eager", "predicted": eager, "measured": measured_eager}]
    for label, budget in (("60%", int(0.6 * eager)), ("45%", int(0.45 * eager)), ("floor", floor)):
        row: dict[str, Any] = {**base, "budget": label, "budget_bytes": budget}
        try:
            plan = make_plan(profile, budget_bytes=budget, strategy="recompute")
        except ConfigError:
            rows.append({**row, "refused": f"below the floor {floor}"})
            continue
        planned = Loop(name, precision, kind)
        planned.step()
        with apply_plan(planned.model, plan):
            planned.step()
            peak = allocator_peak_bytes(planned.step, resident=planned.resident)
        twin = Loop(name, precision, kind)
        for _ in range(planned.count):
            twin.step()
        equal = all(
            torch.equal(a, b)
            for a, b in zip(twin.model.parameters(), planned.model.parameters(), strict=True)
        )
        rows.append(
            {**row, "predicted": plan.predicted_peak_bytes, "measured": peak,
             "within_budget": peak <= budget, "recomputed": plan.count("recompute"),
             "bitwise_equal": equal}
        )  # fmt: skip
    for row in rows:
        if "measured" in row:
            row["predicted_over_measured"] = row["predicted"] / row["measured"] - 1
    return rows


def _enclosing_autocast(name: str) -> dict[str, Any]:
    """The floor with the whole planning call inside the user's autocast, and with
    ``autocast=`` (forward + loss only)."""
    loop = Loop(name, "autocast", "plain")
    loop.step()
    batch = {"input_ids": IDS, "labels": IDS}
    forward_only = plan_for_batch(
        loop.model, batch, budget_fraction=1.0, optimizer=loop.opt, autocast=torch.bfloat16
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        enclosed = plan_for_batch(loop.model, batch, budget_fraction=1.0, optimizer=loop.opt)
    return {
        "model": name,
        "floor_autocast_arg": forward_only.min_budget_bytes,
        "floor_enclosing_autocast": enclosed.min_budget_bytes,
        "enclosing_over_arg": enclosed.min_budget_bytes / forward_only.min_budget_bytes - 1,
    }


def run(out: Path) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    rows = [
        row
        for name in ("llama", "gpt2")
        for precision in PRECISIONS
        for kind in ("plain", "no_trainer")
        for row in _case(name, precision, kind)
    ]
    floors = [_enclosing_autocast(name) for name in ("llama", "gpt2")]
    write_json(out / "mixed_precision.json", rows, enclosing_autocast=floors)
    columns = [
        "model", "precision", "loop", "budget", "budget_bytes", "predicted", "measured",
        "predicted_over_measured", "within_budget", "recomputed", "bitwise_equal", "refused",
    ]  # fmt: skip
    body = (
        "CPU, AdamW, batch 4 x 128 tokens; measured: the c10 allocator's peak of one "
        "steady-state step. Strategy `recompute`.\n\n"
        + markdown_table(rows, columns, floatfmt="+.3%")
        + "\nThe whole `plan_for_batch` call inside the user's autocast against "
        "`autocast=torch.bfloat16`:\n\n"
        + markdown_table(
            floors,
            ["model", "floor_autocast_arg", "floor_enclosing_autocast", "enclosing_over_arg"],
            floatfmt="+.3%",
        )
    )
    write_markdown(out / "mixed_precision.md", "Mixed precision: predicted against measured", body)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/mixed_precision"))
    for record in run(parser.parse_args().out):
        print(record)
