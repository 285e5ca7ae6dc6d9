"""Below the largest layer on CPU: the LM head + loss in chunks and the optimizer on the host.

A tiny Hugging Face Llama whose vocabulary makes the head matter (hidden 256, 4 layers, 4/2
heads, MLP 688, vocabulary 32000, batch 4 x 256, fp32, AdamW), one thread. Measured in one run:

1. **The head + loss alone** (hidden states -> loss -> gradients of the hidden states and the
   head's weight): the live-storage peak above its inputs and the process CPU time, for the
   unchunked loss (Hugging Face's: logits, ``.float()``, cross-entropy), ours (PyTorch's chunked
   op and the fallback loop; logits recomputed or gradients in the forward) and TRL's fused LM
   head (``trl.trainer.utils.add_fused_lm_head``); the loss and gradients' relative error.
2. **The training step**: HF's step as shipped against the same step with the head in chunks
   (CPU time), and against HF's ``gradient_checkpointing_enable()``.
3. **Plans**: each strategy's floor (planned from a profile, chunked profiles included) executed
   with real tensors at that budget: measured peak against budget and prediction; our lowest
   floor over HF checkpointing's peak, on one device and per rank under DDP (2 gloo ranks: the
   host optimizer, the one strategy below the device floor that DDP can use).

    .venv/bin/python benchmarks/below_largest_layer.py [--out benchmarks/results/below_largest_layer]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from superneurons.bench.artifacts import markdown_table, write_json, write_markdown
from superneurons.bench.memory.meter import device_peak_bytes
from superneurons.memory import apply_plan, make_plan, min_peak_bytes, profile_step
from superneurons.memory.chunked.headloss import chunk_tokens_for, linear_cross_entropy
from superneurons.memory.profiling.below import below_profiles

HIDDEN, LAYERS, HEADS, KV_HEADS, MLP, VOCAB = 256, 4, 4, 2, 688, 32000
BATCH, SEQ = 4, 256
STEPS = 3
MiB = 2**20


def tiny_llama() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
        max_position_embeddings=SEQ, use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).train()


def batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def cpu_seconds(step: Callable[[], None], repeats: int = STEPS) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return statistics.median(times)


# --- 1. the head + loss alone ----------------------------------------------------------------
def head_records() -> list[dict[str, Any]]:
    model = tiny_llama()
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    labels = batch()["labels"]
    weight = model.lm_head.weight.detach()
    tokens = BATCH * SEQ
    chunk = chunk_tokens_for(tokens, HIDDEN, VOCAB)

    def hf_loss(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return model.loss_function(logits=F.linear(h, w), labels=labels, vocab_size=VOCAB)

    def ours(mode: str, impl: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)

        def loss(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return linear_cross_entropy(
                h.reshape(-1, HIDDEN), w, shifted, chunk_tokens=chunk, mode=mode, impl=impl
            )

        return loss

    def trl_loss(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        from trl.trainer import utils as trl_utils

        # TRL's fused head, as add_fused_lm_head calls it on CPU (every position scored)
        h, targets = h[:, :-1], labels[:, 1:]
        mask = targets != -100
        per_token = trl_utils._ChunkedLogProbFunction.apply(
            h.reshape(-1, HIDDEN), w, None, targets.clamp(min=0).reshape(-1), 1.0,
            trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs",),
        )  # fmt: skip
        return -(per_token[0].view(mask.shape) * mask).sum() / mask.sum()

    methods: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "unchunked (HF loss)": hf_loss,
        "ours native recompute": ours("recompute", "native"),
        "ours native grad-in-forward": ours("grad-in-forward", "native"),
        "ours pure recompute": ours("recompute", "pure"),
        "ours pure grad-in-forward": ours("grad-in-forward", "pure"),
        "TRL fused LM head": trl_loss,
    }
    reference: tuple[torch.Tensor, ...] | None = None
    records = []
    for name, loss_of in methods.items():
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()

        def step(h: torch.Tensor = h, w: torch.Tensor = w, loss_of: Any = loss_of) -> None:
            h.grad = w.grad = None
            loss_of(h, w).backward()

        inputs = [h, w, labels]
        # above its inputs (both hold the weight's gradient, V x H)
        peak = device_peak_bytes(step, resident=inputs) - sum(
            t.numel() * t.element_size() for t in inputs
        )
        seconds = cpu_seconds(step)
        h.grad = w.grad = None
        loss = loss_of(h, w)
        loss.backward()
        values = (loss.detach(), h.grad, w.grad)
        if reference is None:
            reference = values
        errors = [
            float((a.double() - b.double()).norm() / b.double().norm())
            for a, b in zip(values, reference, strict=True)
        ]
        records.append(
            {
                "method": name,
                "chunk_tokens": chunk if name.startswith("ours") else None,
                "peak_mib": peak / MiB,
                "cpu_s": seconds,
                "loss_rel_err": errors[0],
                "hidden_grad_rel_err": errors[1],
                "weight_grad_rel_err": errors[2],
            }
        )
    base_peak, base_s = records[0]["peak_mib"], records[0]["cpu_s"]
    for record in records:
        record["peak_over_unchunked"] = record["peak_mib"] / base_peak
        record["time_over_unchunked"] = record["cpu_s"] / base_s
    return records


# --- 2. + 3. steps and plans -------------------------------------------------------------------
class BatchLoss(nn.Module):
    """``batch -> model(**batch).loss``: the step the HF integrations plan."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**inputs).loss


def _loss_is_output(out: torch.Tensor, _targets: Any) -> torch.Tensor:
    return out


def profiles() -> tuple[Any, list[Any]]:
    step = BatchLoss(tiny_llama())
    opt = adamw(step.parameters())
    b = batch()
    options = dict(fake=True, keep_output=False)
    plain = profile_step(step, b, None, _loss_is_output, opt, **options)
    chunked = below_profiles(
        step, b, None, _loss_is_output, opt, profile=plain, tokens=BATCH * SEQ, seq_len=SEQ,
        **options,
    )  # fmt: skip
    return plain, chunked


class TrlFusedLoss(nn.Module):
    """``batch -> model(**batch, fused_lm_head=True).loss`` after TRL's ``add_fused_lm_head``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)
        self.model = model

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**inputs, fused_lm_head=True).loss


def measured_step(
    plan: Any | None, *, checkpointing: bool = False, trl: bool = False
) -> tuple[int, float, Any]:
    """(peak bytes, CPU s/step, handle) of the HF step as shipped, under ``plan``, with HF's
    gradient checkpointing, or with TRL's fused LM head (and HF's checkpointing)."""
    step: nn.Module = TrlFusedLoss(tiny_llama()) if trl else BatchLoss(tiny_llama())
    b = batch()
    if checkpointing:
        step.model.gradient_checkpointing_enable()
    handle = None
    opt: torch.optim.Optimizer = adamw(step.parameters())
    if plan is not None:
        factory = adamw if (plan.host_optimizer or plan.optimizer_in_backward) else None
        handle = apply_plan(step, plan, optimizer_factory=factory)
        if handle.optimizer is not None:
            opt = handle.optimizer

    def one() -> None:
        opt.zero_grad(set_to_none=True)
        step(b).backward()
        if plan is None or not plan.optimizer_in_backward:
            opt.step()

    one()  # warm-up: optimizer state exists
    state = [] if handle is not None and handle.optimizer is not None else [
        t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
    ]  # fmt: skip
    if handle is not None and handle.optimizers:
        state = [
            t for o in handle.optimizers.values() for s in o.state.values()
            for t in s.values() if torch.is_tensor(t)
        ]  # fmt: skip
    # optimizer state in the host pool (offload+opt-on-host) is host memory: registered first
    # as such, the state tensors that are its views are then not counted again
    host = handle.pool.host_buffers() if handle is not None else []  # the activation slab
    if handle is not None and handle.host_state is not None:
        host += handle.host_state.host_buffers()
    peak = device_peak_bytes(
        one, resident=[*step.parameters(), *step.buffers(), *state, *b.values()], host=host
    )
    seconds = cpu_seconds(one)
    return peak, seconds, handle


def step_records(plain: Any, chunked: list[Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    records = []
    eager_peak, eager_s, _ = measured_step(None)
    gc_peak, gc_s, _ = measured_step(None, checkpointing=True)
    records.append(
        {"method": "HF as shipped (eager)", "peak_mib": eager_peak / MiB, "cpu_s": eager_s}
    )
    records.append(
        {"method": "HF gradient_checkpointing_enable()", "peak_mib": gc_peak / MiB, "cpu_s": gc_s}
    )
    trl_peak, trl_s, _ = measured_step(None, checkpointing=True, trl=True)
    records.append(
        {
            "method": "HF checkpointing + TRL fused LM head",
            "peak_mib": trl_peak / MiB,
            "cpu_s": trl_s,
        }
    )
    for label, profile in (("grad-in-forward", chunked[0]), ("recompute", chunked[1])):
        plan = make_plan(profile, budget_bytes=1 << 40, strategy="eager")
        peak, seconds, handle = measured_step(plan)
        handle.remove()
        records.append(
            {
                "method": f"HF + head in chunks ({label})",
                "peak_mib": peak / MiB,
                "cpu_s": seconds,
                "predicted_mib": plan.predicted_peak_bytes / MiB,
            }
        )
    floors = min_peak_bytes(plain, chunked=chunked)
    for strategy, floor in floors.items():
        if strategy == "eager":
            continue
        plan = make_plan(plain, budget_bytes=floor, strategy=strategy, chunked=chunked)
        peak, seconds, handle = measured_step(plan)
        handle.remove()
        records.append(
            {
                "method": f"plan {strategy} at its floor",
                "budget_mib": floor / MiB,
                "predicted_mib": plan.predicted_peak_bytes / MiB,
                "peak_mib": peak / MiB,
                "cpu_s": seconds,
                "head": None if plan.head is None else f"{plan.head.mode}/{plan.head.chunk_tokens}",
                "mlp_pieces": max((c.chunks for c in plan.seq_chunks), default=1),
                "within_budget": peak <= plan.budget_bytes,
                "measured_over_predicted": peak / plan.predicted_peak_bytes,
            }
        )
    for record in records:
        record["cpu_over_eager"] = record["cpu_s"] / eager_s
        record["peak_over_hf_checkpointing"] = record["peak_mib"] * MiB / gc_peak
    lowest = min(floors[s] for s in floors)
    summary = {
        "eager_peak_mib": eager_peak / MiB,
        "hf_checkpointing_peak_mib": gc_peak / MiB,
        "lowest_floor_mib": lowest / MiB,
        "lowest_floor_strategy": min(floors, key=lambda s: floors[s]),
        "lowest_floor_over_hf_checkpointing": lowest / gc_peak,
    }
    return records, summary


# --- DDP, 2 gloo ranks ------------------------------------------------------------------------
def _rank(rank: int, world: int, port: int, plan: Any, out: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    b = batch()
    results = {}
    for label in ("hf_checkpointing", "host_optimizer"):
        step = BatchLoss(tiny_llama())
        handle = None
        if label == "hf_checkpointing":
            step.model.gradient_checkpointing_enable()
            ddp = DistributedDataParallel(step)
            opt: torch.optim.Optimizer = adamw(step.parameters())
        else:
            handle = apply_plan(step, plan, optimizer_factory=adamw)
            ddp = DistributedDataParallel(step)
            handle.attach(ddp)
            opt = handle.optimizer

        def one(opt: torch.optim.Optimizer = opt, ddp: nn.Module = ddp) -> None:
            opt.zero_grad(set_to_none=True)
            ddp(b).backward()
            opt.step()

        one()
        state = [] if handle is not None else [
            t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
        ]  # fmt: skip
        # DDP's own gradient buckets are device memory too: count them (its reducer holds them)
        host = handle.pool.host_buffers() if handle is not None else []
        peak = device_peak_bytes(
            one, resident=[*step.parameters(), *step.buffers(), *state, *b.values()], host=host
        )
        results[label] = peak + _ddp_bucket_bytes(ddp)
        if handle is not None:
            handle.remove()
    out.put((rank, results))
    dist.barrier()


def _ddp_bucket_bytes(ddp: nn.Module) -> int:
    """Bytes of the gradient buckets DDP's reducer allocated at construction (one flat
    buffer per bucket: every parameter it manages)."""
    ignored = set(getattr(ddp, "parameters_to_ignore", ()))
    return sum(
        p.numel() * p.element_size()
        for fqn, p in ddp.module.named_parameters()
        if p.requires_grad and fqn not in ignored
    )


def ddp_records(plan: Any) -> dict[str, Any]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, plan, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    return {
        "per_rank_hf_checkpointing_mib": max(r["hf_checkpointing"] for r in results.values()) / MiB,
        "per_rank_host_optimizer_mib": max(r["host_optimizer"] for r in results.values()) / MiB,
        "per_rank_predicted_mib": plan.predicted_peak_bytes / MiB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/below_largest_layer"))
    parser.add_argument(
        "--render", type=Path, help="only write the Markdown of a JSON an earlier run wrote"
    )
    args = parser.parse_args()
    if args.render is not None:
        write_report(json.loads(args.render.read_text()), args.out)
        return
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    heads = head_records()
    plain, chunked = profiles()
    steps, summary = step_records(plain, chunked)
    host = make_plan(
        plain,
        budget_bytes=min_peak_bytes(plain, chunked=chunked)["offload+host-optimizer"],
        strategy="offload+host-optimizer",
        chunked=chunked,
    )
    ddp = ddp_records(host)
    ddp["per_rank_over_hf_checkpointing"] = (
        ddp["per_rank_host_optimizer_mib"] / ddp["per_rank_hf_checkpointing_mib"]
    )
    load = {"loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    config = {
        "model": "LlamaForCausalLM",
        "hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS, "mlp": MLP,
        "vocab": VOCAB, "batch": BATCH, "seq_len": SEQ, "dtype": "fp32", "optimizer": "AdamW fused",
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = write_json(
        args.out / "below_largest_layer.json",
        [*({"table": "head", **r} for r in heads), *({"table": "step", **r} for r in steps)],
        config=config, summary=summary, ddp=ddp, load=load,
    )  # fmt: skip
    write_report(json.loads(path.read_text()), args.out)


def write_report(run: dict[str, Any], out: Path) -> None:
    """The Markdown of one run's JSON (``write_json``'s layout)."""
    heads = [r for r in run["records"] if r["table"] == "head"]
    steps = [r for r in run["records"] if r["table"] == "step"]
    config, summary, ddp, load = run["config"], run["summary"], run["ddp"], run["load"]
    lowest = next(
        r for r in steps if r["method"] == f"plan {summary['lowest_floor_strategy']} at its floor"
    )
    head_cols = ["method", "chunk_tokens", "peak_mib", "peak_over_unchunked", "cpu_s",
                 "time_over_unchunked", "loss_rel_err", "hidden_grad_rel_err",
                 "weight_grad_rel_err"]  # fmt: skip
    step_cols = ["method", "budget_mib", "predicted_mib", "peak_mib", "measured_over_predicted",
                 "within_budget", "peak_over_hf_checkpointing", "cpu_s", "cpu_over_eager", "head",
                 "mlp_pieces"]  # fmt: skip
    measured = run["environment"]
    lines = [
        f"Measured by `{measured['command']}` at {measured['time_utc']}.",
        "",
        f"Tiny Llama ({config}); one thread; load average {load['loadavg_before']} before, "
        f"{load['loadavg_after']} after (timings are CPU time of this process).",
        "",
        "## The head + loss alone",
        "",
        markdown_table(heads, head_cols),
        "",
        "## Training steps and plans (measured with real tensors, live-storage peak)",
        "",
        markdown_table(steps, step_cols),
        "",
        f"Lowest floor {summary['lowest_floor_mib']:.2f} MiB predicted "
        f"({summary['lowest_floor_strategy']}), {lowest['peak_mib']:.2f} MiB measured "
        f"= {lowest['peak_over_hf_checkpointing']:.3f} x HF checkpointing's peak "
        f"({summary['hf_checkpointing_peak_mib']:.1f} MiB).",
        "",
        "## Per rank under DDP (2 gloo ranks, DDP's gradient buckets included)",
        "",
        f"HF checkpointing + DDP {ddp['per_rank_hf_checkpointing_mib']:.1f} MiB; the host "
        f"optimizer {ddp['per_rank_host_optimizer_mib']:.2f} MiB (predicted "
        f"{ddp['per_rank_predicted_mib']:.2f}): {ddp['per_rank_over_hf_checkpointing']:.3f} x.",
    ]
    write_markdown(
        out / "below_largest_layer.md",
        "Below the largest layer: the LM head in chunks, the optimizer on the host (CPU)",
        "\n".join(lines),
    )


if __name__ == "__main__":
    main()
