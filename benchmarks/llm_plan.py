"""What fits, for Hugging Face causal LMs from their configurations: ``plan --model hf:...``
against the estimators people use, measured in one run.

For each shipped configuration (``superneurons.models.hf_configs``), ``superneurons plan
--model hf:NAME --json`` runs as a user runs it (a subprocess: its wall time and peak resident
memory are measured). Beside it, in the same run, the anchors, which count parameters only:

* accelerate's ``estimate-memory`` ("Training using Adam": ``estimate_training_usage`` over
  ``calculate_maximum_sizes`` of the model built with ``init_empty_weights``, as the command
  does; HF's model-memory calculator Space runs this same code);
* DeepSpeed's ``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_...`` (one GPU, no
  offload), imported when deepspeed is installed, else their formulas re-implemented from
  ``deepspeed/runtime/zero/stage_1_and_2.py`` and ``stage3.py`` (0.19): ZeRO-2
  ``4 P + 16 P / gpus``, ZeRO-3 ``4 L + 18 P / gpus`` (P parameters, L the largest layer's);
* the "model training anatomy" rule of the transformers docs (16 bytes per parameter with
  AdamW in fp32, 18 with mixed precision, activations excluded).

A small configuration is also run for real on this CPU (``--truth``): the same command's eager
prediction against the c10 allocator's measured peak, and every anchor against it; and a LoRA
and a QLoRA step of a small Llama (``plan --lora`` / ``--quantize`` against PEFT and
bitsandbytes run for real; ``--adapters-only`` runs just those).

    .venv/bin/python benchmarks/llm_plan.py [--out benchmarks/results/llm_plan] [--quick]
        [--adapters-only]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from superneurons.bench.artifacts import markdown_table, write_json, write_markdown

GIB = 2**30
CASES: list[dict[str, Any]] = [
    {"name": "llama-3-8b", "seq_len": 8192, "batch": 1, "dtype": "bf16"},
    {"name": "qwen2.5-7b", "seq_len": 8192, "batch": 1, "dtype": "bf16"},
    {"name": "llama-3.2-1b", "seq_len": 4096, "batch": 4, "dtype": "bf16"},
    {"name": "gpt2", "seq_len": 1024, "batch": 8, "dtype": "fp32"},
]
MAX_SEQ_CARDS = ("rtx4090", "h100")  # a 24 GiB and an 80 GiB card


def _plan(args: list[str]) -> tuple[Any, float, float]:
    """Run ``superneurons plan ... --json``; (its JSON, wall seconds, peak RSS in GiB)."""
    command = [sys.executable, "-m", "superneurons.cli", "plan", *args, "--json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    wall_s = time.perf_counter() - start
    rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    rss_gib = max(rss_kib, before) / 2**20  # maxrss of the largest child so far
    return json.loads(done.stdout), wall_s, rss_gib


def _parameters(name: str) -> tuple[int, int]:
    """(parameters, largest layer's parameters) of the configuration, built without memory."""
    from accelerate import init_empty_weights
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoModelForCausalLM

    from superneurons.memory.sizing.llm import load_config

    config, _ = load_config(name)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    total_bytes, (largest_bytes, _) = calculate_maximum_sizes(model)
    return total_bytes // 4, largest_bytes // 4


def _anchors(params: int, largest: int, dtype: str) -> dict[str, int]:
    from accelerate.commands.estimate import estimate_training_usage

    usage = estimate_training_usage(4 * params, "float32" if dtype == "fp32" else "bfloat16")
    anchors = {
        "accelerate_estimate_memory": int(max(usage.values())),
        "transformers_anatomy": (16 if dtype == "fp32" else 18) * params,
    }
    try:  # the real functions when deepspeed is installed
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        anchors["deepspeed_zero2"] = int(
            estimate_zero2_model_states_mem_needs(params, 1, 1, False)[0]
        )
        anchors["deepspeed_zero3"] = int(
            estimate_zero3_model_states_mem_needs(params, largest, 1, 1, False, False)[0]
        )
    except ImportError:  # their formulas (0.19), one GPU, no offload
        anchors["deepspeed_zero2"] = 4 * params + 16 * params
        anchors["deepspeed_zero3"] = 4 * largest + 18 * params
    return anchors


def _case(case: dict[str, Any]) -> dict[str, Any]:
    args = ["--model", f"hf:{case['name']}", "--seq-len", str(case["seq_len"])]
    args += ["--batch", str(case["batch"]), "--dtype", case["dtype"], "--device-preset", "h100"]
    record, wall_s, rss_gib = _plan(args)
    params, largest = _parameters(case["name"])
    row: dict[str, Any] = {
        **case,
        "params": params,
        "plan_wall_s": wall_s,
        "plan_rss_gib": rss_gib,
        "optimizer_impl": record["optimizer_impl"],
        "eager_gib": record["eager_peak_bytes"] / GIB,
    }
    for name, floor in record["strategies"].items():
        row[f"floor_{name}_gib"] = floor["min_budget_bytes"] / GIB
        row[f"peak_at_{name}"] = f"{floor['peak_at']['unit']} ({floor['peak_at']['phase']})"
    for name, value in _anchors(params, largest, case["dtype"]).items():
        row[f"{name}_gib"] = value / GIB
        row[f"{name}_over_eager"] = value / record["eager_peak_bytes"]
    row["eager_breakdown_gib"] = {
        k: round(v / GIB, 2) for k, v in record["strategies"]["eager"]["breakdown"].items() if v
    }
    return row


def _max_seq_len() -> list[dict[str, Any]]:
    rows = []
    for card in MAX_SEQ_CARDS:
        args = ["--model", "hf:llama-3-8b", "--dtype", "bf16", "--device-preset", card]
        records, wall_s, _ = _plan([*args, "--max-seq-len"])
        for r in records:
            rows.append(
                {
                    "card": card,
                    "budget_gib": r["budget_bytes"] / GIB,
                    "strategy": r["strategy"],
                    "max_seq_len": r["max_seq_len"],
                    "limited_by_positions": r["limited_by_positions"],
                    "search_wall_s": wall_s,
                }
            )
    return rows


def _truth() -> dict[str, Any]:
    """A small Llama on this CPU: the command's eager prediction and the anchors against the
    c10 allocator's measured peak of the step as HF's no_trainer loop runs it."""
    import tempfile

    import transformers

    from superneurons.bench.memory.meter import allocator_peak_bytes

    config = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=688, vocab_size=2000, max_position_embeddings=512, use_cache=False,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        config.to_json_file(str(path))
        args = ["--model", f"hf:{path}", "--seq-len", "256", "--batch", "4"]
        record, _, _ = _plan([*args, "--device-preset", "cpu", "--budget", "1GiB"])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 2000, (4, 256))
    state: dict[str, Any] = {}

    def step() -> None:
        state["outputs"] = model(input_ids=ids, labels=ids)
        state["outputs"].loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def resident() -> list[torch.Tensor]:
        kept = [v for v in state["outputs"].values() if torch.is_tensor(v)]
        optimizer = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        return [*model.parameters(), *model.buffers(), *optimizer, ids, *kept]

    step()
    measured = allocator_peak_bytes(step, resident=resident)
    params = sum(p.numel() for p in model.parameters())
    row: dict[str, Any] = {
        "config": "llama 4 x 256, 4/2 heads, vocab 2000, batch 4 x 256, fp32, AdamW, CPU",
        "measured_bytes": measured,
        "superneurons_plan_bytes": record["eager_peak_bytes"],
        "superneurons_plan_error": record["eager_peak_bytes"] / measured - 1,
    }
    largest = max(p.numel() for p in model.parameters())
    for name, value in _anchors(params, largest, "fp32").items():
        row[f"{name}_bytes"] = value
        row[f"{name}_error"] = value / measured - 1
    return row


ADAPTER_CASES: list[dict[str, Any]] = [
    {"dtype": "fp32", "quantize": None},
    {"dtype": "bf16", "quantize": None},
    {"dtype": "bf16", "quantize": "nf4"},
]


def _adapter_truth() -> list[dict[str, Any]]:
    """LoRA r = 8 (PEFT, all linear layers) and QLoRA (bitsandbytes nf4 ``Linear4bit``, which
    runs on the CPU) on a small Llama, run for real on this CPU: ``plan --lora`` /
    ``--quantize`` against the c10 allocator's peak, beside what the same command predicts
    without ``--lora`` (a full fine-tune, the only step it could plan before)."""
    import tempfile

    import transformers

    from superneurons.bench.memory.adapted_step import adapted_model, measured_peak_bytes
    from superneurons.memory.sizing.adapters import parse_lora, parse_quantize

    config = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=688, vocab_size=32000, max_position_embeddings=512, use_cache=False,
    )  # fmt: skip
    lora = "r=8,alpha=16,targets=all-linear"
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        config.to_json_file(str(path))
        for case in ADAPTER_CASES:
            args = ["--model", f"hf:{path}", "--seq-len", "128", "--batch", "4"]
            args += ["--dtype", case["dtype"], "--device-preset", "cpu", "--budget", "4GiB"]
            full, _, _ = _plan(args)
            quantize = ["--quantize", case["quantize"]] if case["quantize"] else []
            record, wall_s, _ = _plan([*args, "--lora", lora, *quantize])
            dtype = torch.float32 if case["dtype"] == "fp32" else torch.bfloat16
            torch.manual_seed(0)
            base = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation="sdpa", dtype=dtype
            )
            spec = parse_quantize(case["quantize"]) if case["quantize"] else None
            model = adapted_model(base, parse_lora(lora), spec, compute=dtype)
            ids = torch.randint(0, 32000, (4, 128), generator=torch.Generator().manual_seed(1))
            measured = measured_peak_bytes(model, {"input_ids": ids, "labels": ids})
            rows.append(
                {
                    "dtype": case["dtype"],
                    "quantize": case["quantize"] or "-",
                    "lora": lora,
                    "measured_bytes": measured,
                    "plan_lora_bytes": record["eager_peak_bytes"],
                    "plan_lora_error": record["eager_peak_bytes"] / measured - 1,
                    "plan_full_finetune_over_measured": full["eager_peak_bytes"] / measured,
                    "trainable_params": record["trainable_params"],
                    "frozen_bytes": record["frozen_bytes"],
                    "plan_wall_s": wall_s,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/llm_plan"))
    parser.add_argument("--quick", action="store_true", help="llama-3-8b only, no --max-seq-len")
    parser.add_argument(
        "--adapters-only", action="store_true", help="only the LoRA / QLoRA steps on this CPU"
    )
    args = parser.parse_args()
    if args.adapters_only:
        _write_adapters(args.out, _adapter_truth())
        return
    torch.set_num_threads(1)
    with open("/proc/loadavg") as load:
        loadavg = load.read().split()[:3]
    cases = CASES[:1] if args.quick else CASES
    rows = [_case(case) for case in cases]
    truth = _truth()
    adapters = _adapter_truth()
    searches = [] if args.quick else _max_seq_len()
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(
        args.out / "llm_plan.json",
        rows,
        truth=truth,
        adapters=adapters,
        max_seq_len=searches,
        loadavg=loadavg,
        command=" ".join(sys.argv),
    )
    columns = ["name", "seq_len", "batch", "dtype", "optimizer_impl", "eager_gib"]
    columns += [f"floor_{s}_gib" for s in ("checkpoint", "offload", "offload+opt-on-host")]
    columns += ["accelerate_estimate_memory_gib", "deepspeed_zero2_gib", "transformers_anatomy_gib"]
    columns += ["plan_wall_s", "plan_rss_gib"]
    body = (
        "`superneurons plan --model hf:NAME --device-preset h100` (fake tensors, no weights; "
        f"wall time and peak RSS of the command at load {' '.join(loadavg)} on 2 cores) and "
        "the parameter-count anchors, in GiB.\n\n"
        + markdown_table(rows, columns)
        + "\n\nWhere each strategy's floor is: "
        + "; ".join(f"{r['name']}: {r['peak_at_offload+opt-on-host']}" for r in rows)
        + "\n\nA small Llama run for real on this CPU (c10 allocator's peak of the no_trainer "
        "step) against the same command and the anchors:\n\n"
        + markdown_table([truth], [k for k in truth if k != "config"])
    )
    if searches:
        body += "\n\n`--max-seq-len` for llama-3-8b, bf16, AdamW (foreach):\n\n"
        body += markdown_table(searches, list(searches[0]))
    body += "\n\n" + _adapters_markdown(adapters)
    write_markdown(args.out / "README.md", "What fits: causal LMs from their configuration", body)
    print(json.dumps({"rows": rows, "truth": truth, "max_seq_len": searches}, indent=1))


def _adapters_markdown(adapters: list[dict[str, Any]]) -> str:
    return (
        "LoRA and QLoRA on this CPU (Llama 4 x 256, 4/2 heads, vocab 32000, batch 4 x 128, "
        "AdamW over the adapters; bitsandbytes' nf4 `Linear4bit` runs on the CPU): "
        "`plan --lora` / `--quantize` against the c10 allocator's peak, and the full fine-tune "
        "the command predicts without `--lora`:\n\n"
        + markdown_table(adapters, [k for k in adapters[0] if k != "lora"])
    )


def _write_adapters(out: Path, adapters: list[dict[str, Any]]) -> None:
    """``--adapters-only``: their own files beside the full run's."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "llm_plan_adapters.json", adapters, command=" ".join(sys.argv))
    write_markdown(
        out / "README_adapters.md", "Adapters: plan --lora against a real CPU step",
        _adapters_markdown(adapters),
    )  # fmt: skip
    print(json.dumps(adapters, indent=1))


if __name__ == "__main__":
    main()
