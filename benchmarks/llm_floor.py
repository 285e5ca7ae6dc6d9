"""Floors of a full fine-tune of Llama-3-8B below its largest layer (fake tensors, bytes only).

The Llama-3-8B shape (Meta's published ``config.json``: hidden 4096, 32 layers, 32 query / 8
key-value heads, MLP 14336, vocabulary 128256, untied embeddings), bf16 parameters, AdamW,
batch 1, built under ``FakeTensorMode`` (no weight is materialised) and profiled at each
``--seq-len``: the plain step and the step below the largest layer (the LM head + loss in
chunks, each block's MLP split over the sequence: ``memory.below``). For every strategy: its
floor over both profiles, whether DDP can use it, and for the lowest DDP-capable one the
largest-layer bound (``floor_over_largest_layer``), the head + loss working set and which unit
binds. Bytes are device independent; attention is profiled with the CPU flash kernel, which
holds no ``T x T`` scores (as CUDA's flash / memory-efficient kernels).

    .venv/bin/python benchmarks/llm_floor.py [--seq-len 8192 131072] [--out ...]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from superneurons.bench.artifacts import markdown_table, write_json, write_markdown
from superneurons.memory import default_units, make_plan, min_peak_bytes, profile_step
from superneurons.memory.below import below_profiles
from superneurons.memory.bounds import LOSS, largest_unit_bytes, resident_bytes, working_sets
from superneurons.memory.cost import cost_model

GiB = 2**30
# Meta's Llama-3-8B config.json (huggingface.co/meta-llama/Meta-Llama-3-8B)
LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
# DDP cannot step the optimizer inside backward (before the all-reduce)
NOT_DDP = ("offload+opt-in-backward", "offload+opt-on-host")


class _Step(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


def _loss_is_output(out: torch.Tensor, _targets: Any) -> torch.Tensor:
    return out


def _unit_at(profile: Any, event: int) -> str:
    """The innermost unit whose forward or backward window holds ``event``, with the phase."""
    phase = "backward" if event > profile.forward_end_event else "forward"
    best = ""
    for unit in profile.units:
        for start, end, b_start, b_end in unit.calls or [unit.window(0)]:
            lo, hi = (start, end) if phase == "forward" else (b_start, max(b_end, b_start))
            if 0 <= lo <= event <= hi:
                best = unit.fqn
    return f"{best or '-'} ({phase})"


def floors(seq_len: int) -> dict[str, Any]:
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.set_num_threads(1)
    config = transformers.LlamaConfig(**LLAMA3_8B, use_cache=False, attn_implementation="sdpa")
    mode = FakeTensorMode()
    with mode:
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = transformers.LlamaForCausalLM(config).train()
        finally:
            torch.set_default_dtype(torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        ids = torch.randint(0, config.vocab_size, (1, seq_len))
    step = _Step(model)
    units = ["model." + u for u in default_units(model)]
    options: dict[str, Any] = dict(fake_mode=mode, units=units, keep_output=False)
    start = time.perf_counter()
    plain = profile_step(step, ids, None, _loss_is_output, optimizer, **options)
    chunked = below_profiles(
        step, ids, None, _loss_is_output, optimizer, profile=plain, tokens=seq_len,
        seq_len=seq_len, variants=("recompute+split",), **options,
    )  # fmt: skip
    profiled_s = time.perf_counter() - start
    cost = cost_model("h100")
    minima = min_peak_bytes(plain, cost=cost, chunked=chunked)
    ddp = {s: v for s, v in minima.items() if s not in NOT_DDP}
    best = min(ddp, key=lambda s: ddp[s])
    plan = make_plan(plain, budget_bytes=ddp[best], strategy=best, cost=cost, chunked=chunked)
    below = chunked[0]
    sets = working_sets(below)
    head = plan.head.fqn if plan.head else "model.lm_head"
    plain_sets = working_sets(plain)
    largest = max(sets, key=lambda u: sets[u])
    bound = resident_bytes(below, host_optimizer=plan.host_optimizer) + largest_unit_bytes(below)
    from superneurons.memory.predict import evaluate

    outcome = evaluate(
        below,
        {u.fqn: u.action for u in plan.units},
        cost=cost,
        segments={u.fqn: u.segment for u in plan.units if u.segment >= 0},
        host_optimizer=plan.host_optimizer,
        buckets=plan.grad_buckets or None,
    )
    return {
        "seq_len": seq_len,
        "eager_gib": plain.predicted_peak_bytes() / GiB,
        "floors_gib": {s: v / GiB for s, v in minima.items()},
        "ddp_floor_strategy": best,
        "ddp_floor_gib": ddp[best] / GiB,
        "single_device_floor_gib": min(minima.values()) / GiB,
        "params_gib": plain.param_bytes / GiB,
        "head_loss_working_set_gib": (sets.get(head, 0) + sets.get(LOSS, 0)) / GiB,
        "head_loss_working_set_unchunked_gib": (plain_sets.get(head, 0) + plain_sets.get(LOSS, 0))
        / GiB,
        "largest_unit": largest,
        "largest_unit_gib": sets[largest] / GiB,
        "resident_gib": resident_bytes(below, host_optimizer=plan.host_optimizer) / GiB,
        "floor_over_largest_layer": ddp[best] / bound,
        "peak_at": _unit_at(below, outcome.peak_event),
        "head_chunk_tokens": plan.head.chunk_tokens if plan.head else None,
        "mlp_pieces": max((c.chunks for c in plan.seq_chunks), default=1),
        "grad_buckets": len(plan.grad_buckets),
        "optimizer_host_gib": plan.optimizer_host_bytes / GiB,
        "host_activation_gib": plan.host_bytes / GiB,
        "profile_s": profiled_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, nargs="+", default=[8192, 131072])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/llama3_8b_floor"))
    args = parser.parse_args()
    records = [floors(t) for t in args.seq_len]
    write_json(args.out / "llama3_8b_floor.json", records, config=LLAMA3_8B)
    columns = ["seq_len", "eager_gib", "single_device_floor_gib", "ddp_floor_strategy",
               "ddp_floor_gib", "head_loss_working_set_unchunked_gib",
               "head_loss_working_set_gib", "largest_unit", "largest_unit_gib",
               "floor_over_largest_layer", "peak_at", "head_chunk_tokens",
               "mlp_pieces"]  # fmt: skip
    strategies = [{"seq_len": r["seq_len"], **r["floors_gib"]} for r in records]
    body = "\n".join(
        [
            "Llama-3-8B shape, bf16 parameters, AdamW, batch 1, fake tensors (bytes).",
            "",
            markdown_table(records, columns),
            "",
            "Floor of every strategy (GiB; optimizer-in-backward strategies are single-device):",
            "",
            markdown_table(strategies, ["seq_len", *records[0]["floors_gib"]]),
        ]
    )
    write_markdown(args.out / "llama3_8b_floor.md", "Llama-3-8B below the largest layer", body)


if __name__ == "__main__":
    main()
