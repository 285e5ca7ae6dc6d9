"""Weights streamed on a GPU: a 1B Llama with every block's weights in the host pool against the
same plan with the weights resident, measured in one run (``scripts/gpu-check.sh``'s step).

Both plans come from one real CUDA profile (bf16, AdamW on the host, batch 1, T 2048): the
``offload+host-optimizer`` floor (weights resident) and ``stream-weights`` with every decoder
block's weights streamed (the planner's choice at a budget just above that strategy's floor).
Each runs warm-up steps, then one step's ``torch.cuda.max_memory_allocated`` and the median of
timed steps (CUDA events, ``superneurons.bench.memory.meter.measure_step``).

    python benchmarks/weights_streaming_gpu.py --out OUT [--seq-len 2048] [--steps 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from superneurons.bench.artifacts import markdown_table, write_json, write_markdown
from superneurons.bench.memory.meter import measure_step
from superneurons.memory import apply_plan, make_plan, profile_step
from superneurons.memory.planner.decide import search_floors

GIB = 2**30


def _model(seq_len: int) -> torch.nn.Module:
    import transformers

    from superneurons.models.hf_configs import HF_CONFIGS

    fields = dict(HF_CONFIGS["llama-3.2-1b"].config)
    fields.pop("model_type", None)
    fields["max_position_embeddings"] = max(fields.get("max_position_embeddings", 0), seq_len)
    config = transformers.LlamaConfig(use_cache=False, **fields)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    return model.train()


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-5)


def _loss(output: Any, _targets: Any) -> torch.Tensor:
    return output.loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("weights_streaming_gpu: needs a CUDA device")
    model = _model(args.seq_len)
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq_len), device="cuda")
    batch = {"input_ids": ids, "labels": ids}
    profile = profile_step(model, batch, None, _loss, _adamw(model.parameters()), keep_output=False)
    floors = search_floors(profile).peak_bytes()
    rows = []
    for strategy in ("offload+host-optimizer", "stream-weights"):
        budget = int(floors[strategy] * 1.02)
        plan = make_plan(profile, budget_bytes=budget, strategy=strategy)
        handle = apply_plan(model, plan, optimizer_factory=_adamw)

        def step(handle: Any = handle) -> None:
            model(**batch).loss.backward()
            handle.optimizer.step()

        measured = measure_step(
            step, device=torch.device("cuda"), steps=args.steps, resident=lambda: []
        )
        handle.remove()
        rows.append(
            {
                "strategy": strategy,
                "budget_bytes": budget,
                "predicted_peak_bytes": plan.predicted_peak_bytes,
                "measured_peak_bytes": measured.peak_bytes,
                "within_budget": measured.peak_bytes <= budget,
                "step_s": measured.step_s,
                "units_streamed": len(plan.streamed_units()),
                "streamed_bytes_per_step": plan.streamed_bytes,
                "predicted_exposed_s": plan.exposed_transfer_s,
            }
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join([sys.executable, *sys.argv])
    write_json(out / "weights_streaming_gpu.json", rows, command=command)
    table = markdown_table(
        ["plan", "budget", "predicted", "measured", "step", "units streamed"],
        [
            [
                r["strategy"],
                f"{r['budget_bytes'] / GIB:.2f} GiB",
                f"{r['predicted_peak_bytes'] / GIB:.2f} GiB",
                f"{r['measured_peak_bytes'] / GIB:.2f} GiB",
                f"{r['step_s'] * 1e3:.0f} ms",
                r["units_streamed"],
            ]
            for r in rows
        ],
    )
    write_markdown(
        out / "weights_streaming_gpu.md",
        "A 1B Llama, weights streamed vs resident (one GPU, one run)",
        f"Command: `{command}`\n\n{table}\n",
    )


if __name__ == "__main__":
    main()
