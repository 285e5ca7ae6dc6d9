"""Floors of a full fine-tune of Llama-3-8B below its largest layer (fake tensors, bytes only).

The Llama-3-8B shape (Meta's published ``config.json``: hidden 4096, 32 layers, 32 query / 8
key-value heads, MLP 14336, vocabulary 128256, untied embeddings), bf16 parameters, AdamW,
batch 1, built under ``FakeTensorMode`` (no weight is materialised) and profiled at each
``--seq-len``: the plain step and the step below the largest layer (the LM head + loss in
chunks, each block's MLP split over the sequence: ``memory.profiling.below``), through the library's
own path (``memory.sizing.llm.profile_causal_lm_below``, as ``superneurons plan --model hf:``). For
every strategy: its floor over both profiles, whether DDP can use it, and for the lowest DDP-capable one the
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

from superneurons.bench.artifacts import markdown_table, write_json, write_markdown
from superneurons.memory.planner.bounds import head_loss_bytes
from superneurons.memory.planner.cost import cost_model
from superneurons.memory.planner.decide import strategy_floors
from superneurons.memory.sizing.llm import LMStep, profile_causal_lm_below

GiB = 2**30
# Meta's Llama-3-8B config.json (huggingface.co/meta-llama/Meta-Llama-3-8B)
LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip


def _where(peak_at: dict[str, Any]) -> str:
    return f"{peak_at.get('unit') or '-'} ({peak_at.get('phase', '?')})"


def floors(seq_len: int) -> dict[str, Any]:
    """The library's own path (``superneurons plan --model hf:... --below floor``): the step
    as HF's Trainer runs it (outputs freed before backward), AdamW's single-tensor step."""
    import transformers

    torch.set_num_threads(1)
    config = transformers.LlamaConfig(**LLAMA3_8B, use_cache=False)
    step = LMStep(
        seq_len=seq_len, dtype="bf16", optimizer="adamw", optimizer_impl="single",
        keep_outputs=False, target_device="cpu",
    )  # fmt: skip
    start = time.perf_counter()
    plain, chunked = profile_causal_lm_below(config, step)
    profiled_s = time.perf_counter() - start
    floors = strategy_floors(plain, cost=cost_model("h100"), chunked=chunked)
    ddp = {s: f for s, f in floors.items() if f.supports_ddp}
    best = min(ddp, key=lambda s: ddp[s].min_budget_bytes)
    floor = ddp[best]
    return {
        "seq_len": seq_len,
        "eager_gib": plain.predicted_peak_bytes() / GiB,
        "floors_gib": {s: f.min_budget_bytes / GiB for s, f in floors.items()},
        "ddp_floor_strategy": best,
        "ddp_floor_gib": floor.min_budget_bytes / GiB,
        "single_device_floor_gib": min(f.min_budget_bytes for f in floors.values()) / GiB,
        "params_gib": plain.param_bytes / GiB,
        "head_loss_working_set_gib": floor.head_loss_working_set_bytes / GiB,
        "head_loss_working_set_unchunked_gib": head_loss_bytes(plain) / GiB,
        "largest_unit_gib": floor.largest_unit_bytes / GiB,
        "resident_gib": floor.resident_bytes / GiB,
        "floor_over_largest_layer": floor.floor_over_largest_layer,
        "peak_at": _where(floor.peak_at),
        "head_chunk_tokens": floor.head_chunk_tokens,
        "mlp_pieces": floor.mlp_pieces,
        "optimizer_host_gib": floor.optimizer_host_bytes / GiB,
        "host_activation_gib": floor.host_bytes / GiB,
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
               "head_loss_working_set_gib", "largest_unit_gib",
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
