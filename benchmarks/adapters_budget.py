"""Adapters under a memory budget on CPU: LoRA and QLoRA (PEFT, bitsandbytes), below the LM head.

A tiny Hugging Face Llama whose vocabulary makes the head matter (hidden 256, 4 layers, 4/2
heads, MLP 688, vocabulary 32000), batch 4 x 128, fp32, LoRA r=8 (alpha 16, dropout 0.1) on
q,v and on all linear layers, AdamW on the adapters; QLoRA (q,v): the same weights loaded by
transformers' ``BitsAndBytesConfig`` in nf4 with double quantisation (fp32 compute) on the CPU.
Every arm runs in a process of its own with one thread (``--arm``, started by this script;
``--parallel`` of them at once);
peaks are the c10 CPU allocator's (``superneurons.bench.memory.meter.allocator_peak_bytes``:
every allocation the allocator serves, kernel scratch included) of a steady-state step on top
of what is resident (parameters, buffers, quantization state, AdamW's moments, the batch).
Measured in one run:

1. **The anchor**: HF's ``gradient_checkpointing_enable()`` + the same adapters.
2. **Plans** (``plan_for_batch``, the defaults but ``keep_outputs=False``: this loop keeps only
   the loss): at 60% of the eager prediction and at the minimum the planner names (our floor);
   the prediction against the measured peak; the adapters after 8 steps against an eager
   twin's (its own process); the frozen base weights against their values before training.
3. **HF's ``no_trainer`` loop** (``outputs`` kept through backward) planned with the defaults
   and with ``keep_outputs=False``, at 60% and at the floor.
4. **TRL**: ``SFTTrainer(peft_config=LoraConfig(...))`` alone (``SFTConfig``'s gradient
   checkpointing on) and with ``SuperNeuronsCallback(budget_fraction=0.6)``, in one process and
   on 2 gloo ranks: per-step peaks (the live-storage view the callback's tests use), losses and
   adapters.
5. **What the installed bitsandbytes runs on this CPU** (forward and backward of its layers).

    .venv/bin/python benchmarks/adapters_budget.py [--parallel 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from superneurons.bench.artifacts import markdown_table, pyplot, write_json, write_markdown
from superneurons.bench.memory.meter import allocator_peak_bytes
from superneurons.bench.memory.trainer_meter import TrainerStepPeaks
from superneurons.data.chars import char_tokenizer
from superneurons.errors import ConfigError
from superneurons.integrations.hf import plan_for_batch
from superneurons.memory import InfeasibleBudgetError, apply_plan
from superneurons.memory.profiling.weights import weight_state_tensors

HIDDEN, LAYERS, HEADS, KV_HEADS, MLP, VOCAB = 256, 4, 4, 2, 688, 32000
BATCH, SEQ, STEPS, LR = 4, 128, 8, 1e-3
ADAPTERS = {"q,v": ["q_proj", "v_proj"], "all-linear": "all-linear"}
# QLoRA on q,v only: the 4-bit base's all-linear case is tested (tests/test_adapters_qlora.py)
ADAPTER_SETS = (("lora", "q,v"), ("lora", "all-linear"), ("qlora", "q,v"))
MiB = 2**20
IDS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
        max_position_embeddings=SEQ, use_cache=False, pad_token_id=0, eos_token_id=1,
        bos_token_id=2,
    )  # fmt: skip


def base_model(kind: str, folder: Path) -> Any:
    """The fp32 Llama, or (``qlora``) the saved one loaded in nf4 with double quantisation."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "lora":
        return LlamaForCausalLM(llama_config())
    quant = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )  # fmt: skip
    return AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=quant, device_map="cpu", dtype=torch.float32
    )


def lora_config(targets: Any) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.1, task_type="CAUSAL_LM"
    )


def adapted(kind: str, targets: Any, folder: Path) -> Any:
    import peft

    model = base_model(kind, folder)
    torch.manual_seed(0)
    return peft.get_peft_model(model, lora_config(targets)).train()


class Loop:
    """``model(**batch).loss.backward()``, AdamW on the adapters; ``keep_outputs``: the
    ``outputs`` variable lives until the next step replaces it (HF's ``no_trainer``)."""

    def __init__(self, model: Any, *, keep_outputs: bool = False) -> None:
        self.model = model
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        self.batch = {"input_ids": IDS, "labels": IDS}
        self.keep_outputs, self.kept, self.count = keep_outputs, None, 0
        self.losses: list[float] = []
        self.cpu_s: list[float] = []

    def step(self) -> None:
        torch.manual_seed(self.count)  # dropout: the eager twin's masks
        self.count += 1
        start = time.process_time()
        outputs = self.model(**self.batch)
        loss = outputs.loss
        self.kept = outputs if self.keep_outputs else None
        del outputs
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.cpu_s.append(time.process_time() - start)
        self.losses.append(float(loss.detach()))

    def resident(self) -> list[torch.Tensor]:
        state = [t for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t)]
        kept = [v for v in self.kept.values() if torch.is_tensor(v)] if self.kept else []
        weights = [*self.model.parameters(), *self.model.buffers()]
        return [*weights, *weight_state_tensors(self.model), *state, IDS, *kept]


def named_floor(loop: Loop, **options: Any) -> int:
    try:
        plan_for_batch(loop.model, loop.batch, budget_bytes=1, optimizer=loop.opt, **options)
    except InfeasibleBudgetError as exc:
        return exc.min_budget_bytes
    raise ConfigError("a 1-byte budget was planned")


def trained(loop: Loop) -> dict[str, Any]:
    """What a run is compared by: its losses and its adapters."""
    adapters = {n: p.detach().clone() for n, p in loop.model.named_parameters() if p.requires_grad}
    return {"losses": loop.losses, "adapters": adapters}


def make_loop(spec: dict[str, Any], folder: Path) -> Loop:
    return Loop(
        adapted(spec["kind"], ADAPTERS[spec["adapters"]], folder), keep_outputs=spec["keep"]
    )


def anchor_arm(spec: dict[str, Any], folder: Path) -> dict[str, Any]:
    """HF's ``gradient_checkpointing_enable()`` + the adapters: the step's peak."""
    loop = make_loop(spec, folder)
    loop.model.gradient_checkpointing_enable()
    loop.step()
    return {"peak_bytes": allocator_peak_bytes(loop.step, resident=loop.resident)}


def eager_arm(spec: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Eager for ``STEPS`` steps (the meter's two among them): its peak, and the twin every
    plan is compared with."""
    loop = make_loop(spec, folder)
    loop.step()
    peak = allocator_peak_bytes(loop.step, resident=loop.resident)
    while loop.count < STEPS:
        loop.step()
    return {"peak_bytes": peak, "step_cpu_s": median(loop.cpu_s[1:]), **trained(loop)}


def planned_arm(spec: dict[str, Any], folder: Path) -> dict[str, Any]:
    """One step eager, then ``plan_for_batch`` (``keep_outputs``, ``below`` of ``spec``) at 60%
    of its own eager prediction or at the minimum it names, for the rest of ``STEPS`` steps."""
    loop = make_loop(spec, folder)
    loop.step()
    frozen = {
        n: p.detach().clone() for n, p in loop.model.named_parameters() if not p.requires_grad
    }
    options = {"keep_outputs": spec["plan_keep"], "below": spec["below"]}
    if spec["budget"] == "60% of eager":
        eager = plan_for_batch(
            loop.model, loop.batch, budget_fraction=1.0, optimizer=loop.opt, **options
        )
        budget = int(0.6 * eager.predicted_peak_bytes)
    else:
        budget = named_floor(loop, **options)
    plan = plan_for_batch(
        loop.model, loop.batch, budget_bytes=budget, optimizer=loop.opt, **options
    )
    with apply_plan(loop.model, plan):
        loop.step()
        peak = allocator_peak_bytes(loop.step, resident=loop.resident)
        while loop.count < STEPS:
            loop.step()
    head = plan.head
    return {
        "budget_bytes": budget,
        "predicted_bytes": plan.predicted_peak_bytes,
        "peak_bytes": peak,
        "recompute_units": plan.count("recompute"),
        "head": None if head is None else f"{head.mode}/{head.impl}/{head.chunk_tokens}",
        "step_cpu_s": median(loop.cpu_s[1:]),
        "base_unchanged": all(
            torch.equal(p, frozen[n]) for n, p in loop.model.named_parameters() if n in frozen
        ),
        **trained(loop),
    }


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def bnb_records() -> list[dict[str, Any]]:
    """Which bitsandbytes layers run forward and backward on this CPU, against fp32 Linear."""
    import bitsandbytes as bnb

    layers: dict[str, Callable[[], Any]] = {
        "Linear4bit nf4 + double quant, fp32 compute": lambda: bnb.nn.Linear4bit(
            256, 688, compute_dtype=torch.float32, quant_type="nf4", compress_statistics=True
        ),
        "Linear4bit nf4, bf16 compute": lambda: bnb.nn.Linear4bit(
            256, 688, compute_dtype=torch.bfloat16, quant_type="nf4"
        ),
        "Linear4bit fp4, fp32 compute": lambda: bnb.nn.Linear4bit(
            256, 688, compute_dtype=torch.float32, quant_type="fp4"
        ),
        "Linear8bitLt int8 (threshold 6)": lambda: bnb.nn.Linear8bitLt(
            256, 688, has_fp16_weights=False, threshold=6.0
        ),
    }
    records = []
    for name, build in layers.items():
        torch.manual_seed(0)
        reference = torch.nn.Linear(256, 688)
        record: dict[str, Any] = {"layer": name}
        try:
            layer = build()
            layer.load_state_dict(reference.state_dict())
            layer = layer.to("cpu")  # quantizes
            x = torch.randn(512, 256, requires_grad=True)
            y = layer(x)
            y.float().square().mean().backward()
            x_ref = x.detach().clone().requires_grad_()
            reference(x_ref).square().mean().backward()
            record.update(
                runs=True,
                weight_dtype=str(layer.weight.dtype),
                output_rel_err=float(
                    (y.float() - reference(x).float()).norm() / reference(x).norm()
                ),
                input_grad_rel_err=float((x.grad - x_ref.grad).norm() / x_ref.grad.norm()),
            )
        except Exception as exc:  # what does not run is the finding
            record.update(runs=False, error=f"{type(exc).__name__}: {str(exc)[:160]}")
        records.append(record)
    return records


def trl_texts() -> list[str]:
    gen = torch.Generator().manual_seed(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "sun", "is", "up"]
    return [
        " ".join(words[k] for k in torch.randint(0, 12, (60,), generator=gen).tolist())[: SEQ - 4]
        for _ in range(64)
    ]


def trl_arm(spec: dict[str, Any], folder: Path) -> dict[str, Any]:
    """One SFTTrainer + peft_config (q,v) run of ``STEPS`` steps on this rank, with the callback
    at 0.6 when ``spec["planned"]``: losses, the adapters, the steady per-step peak (plus DDP's
    gradient buckets under DDP, which exist before any step) and the plan's budget."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from superneurons.integrations.transformers import SuperNeuronsCallback

    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = SFTConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, per_device_train_batch_size=BATCH,
        max_steps=STEPS, learning_rate=LR, logging_steps=1, save_strategy="no", report_to=[],
        disable_tqdm=True, seed=0, max_length=SEQ, dataset_num_proc=None,
        ddp_backend="gloo" if world > 1 else None,
    )  # fmt: skip
    trainer = SFTTrainer(
        model=base_model("lora", folder), args=args, processing_class=char_tokenizer(),
        train_dataset=Dataset.from_dict({"text": trl_texts()}),
        peft_config=lora_config(ADAPTERS["q,v"]),
    )  # fmt: skip
    meter = TrainerStepPeaks(trainer)
    callback = SuperNeuronsCallback(trainer, budget_fraction=0.6) if spec["planned"] else None
    if callback is not None:
        trainer.add_callback(callback)
    trainer.add_callback(meter.callback)
    start = time.perf_counter()
    trainer.train()
    named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    buckets = sum(p.numel() * p.element_size() for _, p in named) if world > 1 else 0
    run: dict[str, Any] = {
        "losses": [r["loss"] for r in trainer.state.log_history if "loss" in r],
        "adapters": {n.removeprefix("module."): p.detach().clone() for n, p in named},
        "steady_peak_bytes": max(meter.peaks[1:]) + buckets,  # step 1 makes AdamW's state
        "train_s": time.perf_counter() - start,
    }
    if callback is not None and callback.setup is not None and callback.setup.plan:
        plan, reserved = callback.setup.plan, callback.setup.reserved_bytes
        run["budget_bytes"] = plan.budget_bytes + reserved
        run["predicted_bytes"] = plan.predicted_peak_bytes + reserved
        run["head"] = None if plan.head is None else f"{plan.head.fqn}/{plan.head.chunk_tokens}"
    return run


def bnb_arm(spec: dict[str, Any], folder: Path) -> dict[str, Any]:
    return {"layers": bnb_records()}


ARMS: dict[str, Callable[[dict[str, Any], Path], dict[str, Any]]] = {
    "anchor": anchor_arm, "eager": eager_arm, "planned": planned_arm, "trl": trl_arm,
    "bnb": bnb_arm,
}  # fmt: skip


def arm_main(spec: dict[str, Any], scratch: Path, name: str) -> None:
    """In the arm's own process (one per rank): run it, save its result for the parent."""
    torch.set_num_threads(1)
    result = ARMS[spec["arm"]](spec, scratch / "llama")
    rank = int(os.environ.get("RANK", "0"))
    torch.save(result, scratch / f"{name}-rank{rank}.pt")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from superneurons.train.rank import exit_rank

        exit_rank(0)  # barrier, destroy, exit without racing gloo's threads (pytorch#179291)


class Arms:
    """Starts each arm as ``python adapters_budget.py --arm SPEC`` (``world`` gloo ranks: one
    process each) and reads back what it saved."""

    def __init__(self, scratch: Path) -> None:
        self.scratch, self.count = scratch, itertools.count(1)

    def run(self, world: int = 1, **spec: Any) -> list[dict[str, Any]]:
        name = f"arm{next(self.count)}"  # threads share it: next() on a count is atomic
        command = [sys.executable, __file__, "--arm", json.dumps(spec), "--scratch",
                   str(self.scratch), "--name", name]  # fmt: skip
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        procs, logs = [], []
        for rank in range(world):
            env = dict(os.environ)
            if world > 1:  # one process alone sees no rank: accelerate then wraps no DDP
                env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
            log = (self.scratch / f"{name}-rank{rank}.log").open("w")
            logs.append(log)
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [wait_or_kill(proc, procs) for proc in procs]
        for log in logs:
            log.close()
        if any(codes):
            log_text = self.scratch / f"{name}-rank{[bool(c) for c in codes].index(True)}.log"
            raise ArmFailed(spec, codes, log_text.read_text())
        return [
            torch.load(self.scratch / f"{name}-rank{r}.pt", weights_only=True) for r in range(world)
        ]


class ArmFailed(RuntimeError):
    """An arm that exited with an error: what it printed last is the finding, recorded."""

    def __init__(self, spec: dict[str, Any], codes: list[int], log: str) -> None:
        lines = [line for line in log.splitlines() if line.strip()]
        self.reason = f"exit codes {codes}: {lines[-1][:300] if lines else 'no output'}"
        super().__init__(f"arm {spec}: {self.reason}")


def wait_or_kill(proc: subprocess.Popen[bytes], procs: list[subprocess.Popen[bytes]]) -> int:
    """``proc``'s exit code; past 20 minutes, or when another rank has failed, every rank of the
    arm is stopped (a rank left waiting on a dead peer never hangs the benchmark)."""
    deadline = time.monotonic() + 1200
    while proc.poll() is None:
        failed = any(p.poll() not in (None, 0) for p in procs)
        if failed or time.monotonic() > deadline:
            for other in procs:
                if other.poll() is None:
                    other.kill()
        time.sleep(1)
    return int(proc.returncode)


def compare(run: dict[str, Any], twin: dict[str, Any]) -> dict[str, Any]:
    """A run's adapters and losses against its eager twin's."""
    errors, bitwise = [], True
    for name, expected in twin["adapters"].items():
        got = run["adapters"][name]
        bitwise &= torch.equal(got, expected)
        errors.append(float((got.double() - expected.double()).norm() / expected.double().norm()))
    pairs = zip(run["losses"], twin["losses"], strict=True)
    return {
        "adapters_bitwise": bitwise,
        "adapters_max_rel_err": max(errors),
        "losses_identical": run["losses"] == twin["losses"],
        "loss_max_rel_err": max(abs(x - y) / abs(y) for x, y in pairs),
    }


def in_mib(run: dict[str, Any]) -> dict[str, Any]:
    """A run's record for the table: bytes in MiB, the tensors left out."""
    record = {k: v for k, v in run.items() if k not in ("adapters", "losses")}
    for key in [k for k in record if k.endswith("_bytes")]:
        record[key.removesuffix("_bytes") + "_mib"] = record.pop(key) / MiB
    return record


def planned_record(run: dict[str, Any], twin: dict[str, Any]) -> dict[str, Any]:
    return {
        **in_mib(run),
        "within_budget": run["peak_bytes"] <= run["budget_bytes"],
        "measured_over_predicted": run["peak_bytes"] / run["predicted_bytes"],
        "peak_over_budget": run["peak_bytes"] / run["budget_bytes"],
        **compare(run, twin),
    }


def adapter_records(arms: Arms, kind: str, name: str) -> list[dict[str, Any]]:
    """The anchor, eager, and plans at 60% and at the floor for one adapter set."""
    spec = {"kind": kind, "adapters": name, "keep": False}
    (anchor,) = arms.run(arm="anchor", **spec)
    (twin,) = arms.run(arm="eager", **spec)
    row = {"model": f"{kind} {name}", "hf_gc_peak_mib": anchor["peak_bytes"] / MiB}
    records = [{**row, "budget": "eager (no plan)", **in_mib(twin)}]
    for budget in ("60% of eager", "the named floor"):
        planned = dict(spec, plan_keep=False, below=True, budget=budget)
        try:
            (run,) = arms.run(arm="planned", **planned)
        except ArmFailed as exc:
            records.append({**row, "budget": budget, "error": exc.reason})
            continue
        records.append({**row, "budget": budget, **planned_record(run, twin)})
    for record in records:
        if "peak_mib" in record:
            record["peak_over_hf_gc"] = record["peak_mib"] / record["hf_gc_peak_mib"]
    return records


def no_trainer_records(arms: Arms) -> list[dict[str, Any]]:
    """HF's ``no_trainer`` loop (outputs kept) planned with the defaults and with
    ``keep_outputs=False`` (a plan for a loop that keeps only the loss)."""
    spec = {"kind": "lora", "adapters": "q,v", "keep": True}
    (twin,) = arms.run(arm="eager", **spec)
    records = []
    for plan_keep, below in ((True, True), (False, True)):
        for budget in ("60% of eager", "the named floor"):
            planned = dict(spec, plan_keep=plan_keep, below=below, budget=budget)
            options = {"keep_outputs": plan_keep, "below": below, "budget": budget}
            try:
                (run,) = arms.run(arm="planned", **planned)
            except ArmFailed as exc:
                records.append({**options, "error": exc.reason})
                continue
            records.append({**options, **planned_record(run, twin)})
    return records


def trl_compare(alone: dict[str, Any], planned: dict[str, Any]) -> dict[str, Any]:
    return {
        **compare(planned, alone),
        "planned_within_budget": planned["steady_peak_bytes"] <= planned["budget_bytes"],
        "planned_over_trl_alone": planned["steady_peak_bytes"] / alone["steady_peak_bytes"],
    }


def trl_records(arms: Arms, world: int) -> dict[str, Any]:
    """TRL alone and with the callback at 0.6, each in its own process per rank."""
    try:
        alone = arms.run(world=world, arm="trl", planned=False)
        planned = arms.run(world=world, arm="trl", planned=True)
    except ArmFailed as exc:
        return {"world": world, "ranks": [], "ranks_agree": None, "error": exc.reason}
    ranks = [
        {"TRL alone": in_mib(a), "TRL + callback at 0.6": in_mib(p), **trl_compare(a, p)}
        for a, p in zip(alone, planned, strict=True)
    ]
    agree = all(
        torch.equal(planned[0]["adapters"][n], r["adapters"][n])
        for r in planned
        for n in planned[0]["adapters"]
    )
    return {"world": world, "ranks": ranks, "ranks_agree": agree}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/adapters_budget"))
    parser.add_argument("--render", type=Path, help="only write the Markdown of a JSON")
    parser.add_argument(
        "--parallel", type=int, default=3, help="arms run at once (each its own process)"
    )
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # one arm, in a process of its own
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm is not None:
        arm_main(json.loads(args.arm), args.scratch, args.name)
        return
    if args.render is not None:
        write_report(json.loads(args.render.read_text()), args.out)
        return
    import bitsandbytes
    import peft
    import transformers
    import trl
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    load_before = os.getloadavg()
    arms = Arms(Path(tempfile.mkdtemp()))
    torch.manual_seed(0)
    LlamaForCausalLM(llama_config()).save_pretrained(arms.scratch / "llama")  # every arm's base
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:  # each: its arms in sequence
        bnb_job = pool.submit(arms.run, arm="bnb")
        trl_jobs = [pool.submit(trl_records, arms, world) for world in (1, 2)]
        step_jobs = [pool.submit(adapter_records, arms, *which) for which in ADAPTER_SETS]
        no_trainer_job = pool.submit(no_trainer_records, arms)
    (bnb_cpu,) = bnb_job.result()
    trl_runs = [job.result() for job in trl_jobs]
    steps = [record for job in step_jobs for record in job.result()]
    no_trainer = no_trainer_job.result()
    config = {
        "model": "LlamaForCausalLM", "hidden": HIDDEN, "layers": LAYERS, "heads": HEADS,
        "kv_heads": KV_HEADS, "mlp": MLP, "vocab": VOCAB, "batch": BATCH, "seq_len": SEQ,
        "steps": STEPS, "lora": "r=8, alpha=16, dropout=0.1", "optimizer": f"AdamW lr={LR}",
        "qlora": "nf4, double quantisation, fp32 compute (BitsAndBytesConfig)",
    }  # fmt: skip
    versions = {
        "transformers": transformers.__version__, "peft": peft.__version__,
        "trl": trl.__version__, "bitsandbytes": bitsandbytes.__version__,
    }  # fmt: skip
    records = [
        *({"table": "adapters", **r} for r in steps),
        *({"table": "no_trainer", **r} for r in no_trainer),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    path = write_json(
        args.out / "adapters_budget.json", records, config=config, versions=versions,
        trl=trl_runs, bitsandbytes_cpu=bnb_cpu["layers"], parallel=args.parallel,
        load={"loadavg_before": load_before, "loadavg_after": os.getloadavg()},
    )  # fmt: skip
    write_report(json.loads(path.read_text()), args.out)


def write_report(run: dict[str, Any], out: Path) -> None:
    """The Markdown and the PNG of one run's JSON."""
    steps = [r for r in run["records"] if r["table"] == "adapters"]
    no_trainer = [r for r in run["records"] if r["table"] == "no_trainer"]
    load = run["load"]
    floors = [r for r in steps if r["budget"] == "the named floor"]
    lines = [
        f"Tiny Llama ({run['config']}); {run['versions']}; one process per arm, one thread each, "
        f"up to {run['parallel']} arms at once; "
        f"load average {load['loadavg_before']} before, {load['loadavg_after']} after (other "
        "jobs shared the 2 cores: `step_cpu_s` is the arm's CPU time per step, median).",
        "",
        "## LoRA and QLoRA under plans (c10 allocator view)",
        "",
        markdown_table(steps, ADAPTER_COLUMNS),
        "",
        "Our floor over HF checkpointing + the same adapters: "
        + ", ".join(f"{r['model']} {r.get('peak_over_hf_gc', 'failed')}" for r in floors)
        + ". Adapters after 8 steps against the eager run's (its own process; the head's loss "
        "value is summed chunk by chunk: `loss_max_rel_err`).",
        "",
        "## HF's no_trainer loop (outputs kept through backward), LoRA q,v",
        "",
        markdown_table(no_trainer, NO_TRAINER_COLUMNS),
        "",
        "`keep_outputs=True, below=True` are the defaults; `keep_outputs=False` plans for a loop "
        "that keeps only the loss.",
        "",
        "## TRL SFTTrainer + peft_config (q,v), 8 steps (live-storage view, batch excluded)",
        "",
        "Each run in its own process(es); on 2 gloo ranks DDP's gradient buckets are added to "
        "each rank's peak and the budget includes them.",
        "",
        markdown_table(trl_rows(run["trl"]), TRL_COLUMNS),
        "",
        *(trl_summary(t) for t in run["trl"]),
        "",
        "## What the installed bitsandbytes runs on this CPU",
        "",
        markdown_table(
            run["bitsandbytes_cpu"],
            ["layer", "runs", "weight_dtype", "output_rel_err", "input_grad_rel_err", "error"],
        ),  # fmt: skip
    ]
    write_markdown(
        out / "adapters_budget.md",
        "Adapters under a memory budget: LoRA and QLoRA below the LM head (CPU)",
        "\n".join(lines),
    )
    plot(steps, out / "adapters_budget.png")


ADAPTER_COLUMNS = ["model", "budget", "hf_gc_peak_mib", "budget_mib", "predicted_mib", "peak_mib",
                   "measured_over_predicted", "within_budget", "peak_over_hf_gc", "head",
                   "recompute_units", "adapters_bitwise", "adapters_max_rel_err", "base_unchanged",
                   "loss_max_rel_err", "step_cpu_s", "error"]  # fmt: skip
NO_TRAINER_COLUMNS = ["keep_outputs", "below", "budget", "budget_mib", "predicted_mib",
                      "peak_mib", "within_budget", "peak_over_budget", "head", "recompute_units",
                      "adapters_bitwise", "base_unchanged", "error"]  # fmt: skip
TRL_COLUMNS = ["world", "rank", "run", "budget_mib", "predicted_mib", "steady_peak_mib", "head",
               "train_s"]  # fmt: skip


def trl_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"world": t["world"], "rank": r, "run": k, **v}
        for t in runs
        for r, rank in enumerate(t["ranks"])
        for k, v in rank.items()
        if isinstance(v, dict)
    ]


def trl_summary(run: dict[str, Any]) -> str:
    ranks = "; ".join(
        f"rank {r}: losses identical {x['losses_identical']} (max rel. err. "
        f"{x['loss_max_rel_err']:.2g}), adapters bitwise {x['adapters_bitwise']} (max rel. err. "
        f"{x['adapters_max_rel_err']:.2g}), within budget {x['planned_within_budget']}, "
        f"{x['planned_over_trl_alone']:.3f}x TRL alone's peak"
        for r, x in enumerate(run["ranks"])
    )
    if "error" in run:
        return f"- {run['world']} process(es): failed, {run['error']}"
    agree = f"; the ranks' adapters agree: {run['ranks_agree']}" if run["world"] > 1 else ""
    return f"- {run['world']} process(es): {ranks}{agree}."


def plot(steps: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    models = list(dict.fromkeys(r["model"] for r in steps))

    def peak(model: str, budget: str) -> float:  # a failed arm: no bar
        row = next(r for r in steps if r["model"] == model and r["budget"] == budget)
        return float(row.get("peak_mib", 0.0))

    series = {
        "HF gradient checkpointing": [
            next(r["hf_gc_peak_mib"] for r in steps if r["model"] == m) for m in models
        ],
        "plan at 60% of eager": [peak(m, "60% of eager") for m in models],
        "plan at our floor": [peak(m, "the named floor") for m in models],
    }
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(models))], values, width, label=label)
    ax.set_xticks([x + width for x in range(len(models))], models)
    ax.set_ylabel("measured step peak (MiB, c10 allocator)")
    ax.set_title("Tiny Llama (vocab 32000), batch 4 x 128, adapters r=8, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
