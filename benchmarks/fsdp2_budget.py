"""FSDP2 under a byte budget, per rank: plans on a ``fully_shard``-ed model against eager and
torchtitan-style checkpointing, on 2 gloo ranks (CPU).

A tiny Hugging Face Llama (hidden 256, 4 layers, 4/2 heads, MLP 688, vocabulary 2000, batch
4 x 256 per rank, fp32, AdamW), every decoder layer and the root ``fully_shard``-ed, one thread
per rank. Measured in one run, on every rank:

1. **FSDP2 eager**: the per-rank peak.
2. **Ours** (``plan_for_batch`` + ``apply_plan``) at 60% of eager's predicted peak and at the
   recompute floor ``plan_for_batch`` reports: budget, predicted and measured peak, whether the
   ranks ran the same plan, and the parameters after the steps against eager's (bitwise).
3. **The anchor**: torchtitan's full activation checkpointing (``checkpoint_wrapper`` on every
   decoder layer, applied before ``fully_shard``): its measured peak.

Peaks are the c10 CPU allocator's (``allocator_step_bytes``: resident state included; a step
in which a gloo worker thread freed a buffer the profiler did not see is measured again, on
every rank) with the live-storage tracker's beside them; time is the median process CPU time
of a step.

    .venv/bin/python benchmarks/fsdp2_budget.py [--out benchmarks/results/fsdp2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from superneurons.bench.artifacts import markdown_table, write_json, write_markdown
from superneurons.bench.memory.meter import allocator_step_bytes, device_peak_bytes

HIDDEN, LAYERS, HEADS, KV_HEADS, MLP, VOCAB = 256, 4, 4, 2, 688, 2000
BATCH, SEQ = 4, 256
WORLD = 2
STEPS = 3
ATTEMPTS = 8  # allocator measurements of a step while a rank's profiler missed a free
MiB = 2**20


def tiny_llama(*, checkpointed: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model, sharded per decoder layer and at the root; ``checkpointed``: torchtitan's
    full activation checkpointing, each layer wrapped before ``fully_shard``."""
    import transformers
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
        max_position_embeddings=SEQ, use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).train()
    layers = model.model.layers
    for index, layer in enumerate(layers):
        if checkpointed:  # torchtitan: ptd_checkpoint_wrapper(..., preserve_rng_state=False)
            layer = checkpoint_wrapper(layer, preserve_rng_state=False)
            layers[index] = layer
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def batch(rank: int, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, b: dict[str, Any]) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(**b).loss.backward()
    optimizer.step()


def shards(model: nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def measure(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> dict[str, Any]:
    """One step, then the per-rank peaks of the next; the shards after those; CPU time."""
    train_step(model, optimizer, batch(rank, 0))
    b = batch(rank, 1)

    def resident() -> list[torch.Tensor]:
        state = [t for s in optimizer.state.values() for t in s.values()]
        return [*model.parameters(), *state, *b.values()]

    after: list[torch.Tensor] = []
    attempts = 0
    # every rank measures again while any rank saw an unfreed block (``attempts`` is reported)
    for attempts in range(1, ATTEMPTS + 1):  # noqa: B007
        peak, unfreed = allocator_step_bytes(
            lambda: train_step(model, optimizer, b), resident=resident
        )
        after = after or shards(model)
        seen = torch.tensor([unfreed])
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        if int(seen) == 0:
            break
    tracked = device_peak_bytes(lambda: train_step(model, optimizer, b), resident=resident())
    return {
        "peak": peak,
        "tracked": tracked,
        "attempts": attempts,
        "unfreed": int(seen),
        "cpu_s": cpu_seconds(lambda: train_step(model, optimizer, b)),
        "shards": after,
    }


def cpu_seconds(step: Callable[[], None]) -> float:
    times = []
    for _ in range(STEPS):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return statistics.median(times)


def rank_records(rank: int) -> list[dict[str, Any]]:
    from superneurons.integrations.hf import plan_for_batch
    from superneurons.memory import InfeasibleBudgetError, apply_plan

    rows: list[dict[str, Any]] = []
    model, optimizer = tiny_llama()
    eager_plan = plan_for_batch(
        model,
        batch(rank, 0),
        budget_fraction=1.0,
        strategy="eager",
        optimizer=optimizer,
        keep_outputs=False,
    )
    eager = measure(model, optimizer, rank)
    eager_predicted = eager_plan.predicted_peak_bytes
    rows.append(row(rank, "FSDP2 eager", None, eager_predicted, eager, eager, eager_predicted))
    for label in ("ours at 60%", "ours at the recompute floor"):
        model, optimizer = tiny_llama()
        start = time.perf_counter()
        if label == "ours at 60%":
            budget = int(0.6 * eager_predicted)
        else:
            try:
                plan_for_batch(
                    model, batch(rank, 0), budget_bytes=1, optimizer=optimizer, keep_outputs=False
                )
            except InfeasibleBudgetError as exc:
                budget = exc.min_budget_bytes
        plan = plan_for_batch(
            model, batch(rank, 0), budget_bytes=budget, optimizer=optimizer, keep_outputs=False
        )
        plan_s = time.perf_counter() - start
        agreed: list[Any] = [None] * WORLD
        dist.all_gather_object(agreed, plan.to_json())
        with apply_plan(model, plan):
            ours = measure(model, optimizer, rank)
        rows.append(
            row(rank, label, budget, plan.predicted_peak_bytes, ours, eager, eager_predicted)
            | {
                "same_plan_on_all_ranks": len(set(agreed)) == 1,
                "recompute_units": plan.count("recompute"),
                "profile_and_plan_s": plan_s,
            }
        )
    model, optimizer = tiny_llama(checkpointed=True)
    anchor = measure(model, optimizer, rank)
    rows.append(row(rank, "torchtitan full AC", None, None, anchor, eager, eager_predicted))
    return rows


def row(
    rank: int,
    method: str,
    budget: int | None,
    predicted: int | None,
    got: dict[str, Any],
    eager: dict[str, Any],
    eager_predicted: int,
) -> dict[str, Any]:
    same = all(torch.equal(a, b) for a, b in zip(got["shards"], eager["shards"], strict=True))
    return {
        "rank": rank,
        "method": method,
        "budget_mib": None if budget is None else budget / MiB,
        "budget_over_eager_predicted": None if budget is None else budget / eager_predicted,
        "predicted_mib": None if predicted is None else predicted / MiB,
        "peak_mib": got["peak"] / MiB,
        "peak_bytes": got["peak"],
        "tracked_peak_mib": got["tracked"] / MiB,
        "measured_minus_predicted_bytes": None if predicted is None else got["peak"] - predicted,
        "within_budget": None if budget is None else got["peak"] <= budget,
        "peak_over_eager": got["peak"] / eager["peak"],
        "params_bitwise_equal_eager": same,
        "measure_attempts": got["attempts"],
        "unfreed_bytes": got["unfreed"],
        "cpu_s": got["cpu_s"],
        "cpu_over_eager": got["cpu_s"] / eager["cpu_s"],
    }


def _rank(rank: int, port: int, out: Any) -> None:
    from superneurons.train.rank import exit_rank

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=300)
    )
    try:
        out.put((rank, rank_records(rank)))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        out.put((rank, repr(exc)))
        out.close()
        out.join_thread()
        exit_rank(1)
    out.close()
    out.join_thread()
    exit_rank(0)


def run_ranks() -> list[dict[str, Any]]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    results = dict(out.get(timeout=1800) for _ in range(WORLD))
    for proc in procs:
        proc.join(timeout=60)
    failed = {r: v for r, v in results.items() if isinstance(v, str)}
    if failed:
        raise RuntimeError(f"ranks failed: {failed}")
    return [r for rank in sorted(results) for r in results[rank]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fsdp2"))
    parser.add_argument(
        "--render", type=Path, help="only write the Markdown of a JSON an earlier run wrote"
    )
    args = parser.parse_args()
    if args.render is not None:
        write_report(json.loads(args.render.read_text()), args.out)
        return
    load_before = os.getloadavg()
    records = run_ranks()
    config = {
        "model": "LlamaForCausalLM", "hidden": HIDDEN, "layers": LAYERS, "heads": HEADS,
        "kv_heads": KV_HEADS, "mlp": MLP, "vocab": VOCAB, "batch_per_rank": BATCH,
        "seq_len": SEQ, "dtype": "fp32", "optimizer": "AdamW", "ranks": WORLD,
        "backend": "gloo", "sharding": "fully_shard per decoder layer + root",
        "threads_per_rank": 1,
    }  # fmt: skip
    load = {"loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    path = write_json(args.out / "fsdp2_budget.json", records, config=config, load=load)
    write_report(json.loads(path.read_text()), args.out)


def write_report(run: dict[str, Any], out: Path) -> None:
    """The Markdown of one run's JSON (``write_json``'s layout)."""
    columns = ["rank", "method", "budget_mib", "budget_over_eager_predicted", "predicted_mib",
               "peak_mib", "measured_minus_predicted_bytes", "within_budget", "tracked_peak_mib",
               "peak_over_eager", "params_bitwise_equal_eager", "same_plan_on_all_ranks",
               "recompute_units", "measure_attempts", "unfreed_bytes", "cpu_s",
               "cpu_over_eager"]  # fmt: skip
    measured = run["environment"]
    body = "\n".join(
        [
            f"Measured by `{measured['command']}` at {measured['time_utc']}.",
            "",
            f"Tiny Llama ({run['config']}); load average {run['load']['loadavg_before']} before, "
            f"{run['load']['loadavg_after']} after (CPU time per rank, two ranks on a shared "
            "machine).",
            "",
            "Peaks per rank, MiB = 2^20 B: the c10 CPU allocator's (`peak_mib`, resident state "
            "included) and the live-storage tracker's (`tracked_peak_mib`). `within_budget`: "
            "allocator peak <= budget. `unfreed_bytes`: what the measured step allocated and the "
            "profiler saw no free of (a gloo worker thread's free; the step is measured again, "
            "up to 8 times, while any rank has some; the last one is reported). The anchor is torchtitan's full activation "
            "checkpointing (`checkpoint_wrapper` on every decoder layer, applied before "
            "`fully_shard`).",
            "",
            markdown_table(run["records"], columns),
        ]
    )
    write_markdown(out / "fsdp2_budget.md", "FSDP2 under a byte budget, per rank", body)


if __name__ == "__main__":
    main()
