"""Plan keep / offload / recompute for a model under a device byte budget (fake tensors).

Profiles one training step on fake tensors (no memory is used, no weights are read) and prints
every strategy's floor and the plan for the budget:

    superneurons plan --model resnet --depth 590 --batch 16 --budget 12GiB
    superneurons plan --model gpt --batch 8 --budget 12GiB --optimizer adamw --json
    superneurons plan --model hf:llama-3-8b --seq-len 8192 --dtype bf16 --device-preset h100
    superneurons plan --model hf:path/to/config.json --seq-len 4096 --autocast bf16 --budget 24GiB
    superneurons plan --model resnet --batch 16 --budget 11.4GiB --max-depth
    superneurons plan --model hf:llama-3.2-1b --device-preset rtx4090 --max-seq-len

``--model hf:NAME_OR_PATH`` builds a Hugging Face causal LM from a configuration
(``superneurons.models.hf_configs`` ships a few by name; a path is any ``config.json``) and
profiles the step as people write it, modelling the target device's attention kernels and
optimizer implementation (``superneurons.memory.sizing.llm``). ``--max-depth`` / ``--max-batch`` /
``--max-seq-len`` search the largest size whose smallest predicted peak fits, per strategy (an
affine fit over three profiled sizes, ``superneurons.memory.sizing.search``). For ``hf:`` models the
planner also searches the step below the largest layer (``--below``: the LM head + loss in chunks,
block MLPs over sequence pieces, ``superneurons.memory.profiling.below``). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from superneurons.bytesize import format_bytes
from superneurons.commands.plan_search import SEQ_QUANTUM, run_search
from superneurons.commands.plan_target import BELOW, ZOO_BUDGET, progress, request_of
from superneurons.errors import ConfigError
from superneurons.memory.plan import STRATEGIES, Plan
from superneurons.memory.planner.cost import DEVICE_PRESETS, HOST_LINKS
from superneurons.memory.profile_types import GRANULARITIES
from superneurons.memory.sizing.llm import DTYPES, OPTIMIZER_IMPLS
from superneurons.memory.sizing.model_plan import plan_model
from superneurons.memory.sizing.simulate import OPTIMIZERS
from superneurons.memory.sizing.target import LMTarget

HELP = "plan keep/offload/recompute per unit under a memory budget (fake tensors)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="resnet",
        help="zoo model (resnet, resnet50, gpt, ...) or hf:NAME_OR_PATH, a causal LM from a "
        "shipped configuration (llama-3-8b, llama-3.1-8b, llama-3.3-70b, llama-3.2-1b, qwen2.5-7b, "
        "gpt2) or a config.json",
    )
    parser.add_argument(
        "--depth", type=int, default=None, help="resnet depth (3n + 134 or 50/101/152)"
    )
    parser.add_argument("--batch", type=int, default=None, help="batch size (16; hf: 1)")
    parser.add_argument(
        "--budget",
        default=None,
        help=f"device budget, e.g. 12GiB (default {ZOO_BUDGET}; hf: the device preset's memory)",
    )
    parser.add_argument("--strategy", default="auto", choices=STRATEGIES)
    parser.add_argument("--image-size", type=int, default=None, help="image side (default 224)")
    parser.add_argument(
        "--optimizer", default=None, choices=tuple(OPTIMIZERS), help="default sgd; hf: adamw"
    )
    parser.add_argument("--preset", default=None, help="gpt preset (default gpt2)")
    parser.add_argument(
        "--device-preset",
        default="a100",
        choices=tuple(DEVICE_PRESETS),
        help="the device: speeds of the cost model and memory size (memory.planner.cost.DEVICE_PRESETS; "
        "default a100)",
    )
    parser.add_argument(
        "--bandwidth",
        default=None,
        help="host<->device rate: 16GB/s, 128gbit, or a byte size per second (default: the "
        "preset's)",
    )
    add_link_arguments(parser)
    parser.add_argument(
        "--granularity",
        default=None,
        choices=(*GRANULARITIES, "auto"),
        help="units: blocks plus the rest of the step, every layer, the largest blocks split "
        "into layers, or auto: block or split, whichever gives the strategy the lower floor "
        "(default auto; hf: block)",
    )
    lm = parser.add_argument_group("language models (--model hf:...)")
    lm.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (2048)")
    lm.add_argument("--dtype", default="fp32", choices=tuple(DTYPES), help="parameter dtype")
    lm.add_argument(
        "--autocast", default=None, choices=("bf16",), help="forward + loss under autocast"
    )
    lm.add_argument(
        "--optimizer-impl",
        default=None,
        choices=OPTIMIZER_IMPLS,
        help="default: what torch.optim runs on the target device (foreach on cuda)",
    )
    lm.add_argument(
        "--target-device",
        default=None,
        choices=("cuda", "cpu"),
        help="whose kernels are modelled (default: cpu for --device-preset cpu, else cuda)",
    )
    lm.add_argument(
        "--keep-outputs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the loop keeps outputs (the logits) alive through backward, as HF's no_trainer "
        "examples do (default); --no-keep-outputs: freed before backward, as HF's Trainer",
    )
    lm.add_argument(
        "--below",
        default="floor",
        choices=tuple(BELOW),
        help="profiles below the largest layer the planner also searches: floor (default: the "
        "LM head + loss in chunks and block MLPs over sequence pieces, one more profile), all "
        "(also the head alone, recomputing or computing its gradient in the forward), off",
    )
    add_adapter_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    _add_step_arguments(parser)
    search = parser.add_mutually_exclusive_group()
    search.add_argument("--max-depth", action="store_true", help="largest resnet depth that fits")
    search.add_argument("--max-batch", action="store_true", help="largest batch that fits")
    search.add_argument(
        "--max-seq-len",
        action="store_true",
        help=f"hf: longest sequence (x{SEQ_QUANTUM}) that fits",
    )
    add_search_arguments(parser)


def add_link_arguments(parser: argparse.ArgumentParser) -> None:
    """``--host-link`` and ``--host-budget``: the host link's rate and the pinned host memory a
    plan may need."""
    parser.add_argument(
        "--host-link",
        default=None,
        choices=tuple(HOST_LINKS),
        help="the host<->device link whose effective rate the copies take (memory.planner.cost."
        "HOST_LINKS: PCIe 4.0 x16 25 GB/s, PCIe 5.0 x16 50 GB/s, GH200 NVLink-C2C 360 GB/s; "
        "default: the device preset's rates)",
    )
    parser.add_argument(
        "--host-budget",
        default=None,
        help="pinned host memory the plan may need (offloaded activations, the optimizer's "
        "state and masters, streamed weights), e.g. 256GiB: a plan needing more is refused",
    )


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """How a causal LM is planned past its positions and searched (``--max-seq-len`` /
    ``--max-batch``)."""
    lm = parser.add_argument_group(
        "hf: models past their positions, and their searches (--max-seq-len, --max-batch)"
    )
    lm.add_argument(
        "--beyond-positions",
        action="store_true",
        help="a model with rotary positions: --max-seq-len also searches what memory allows "
        "past the configuration's max_position_embeddings (max_seq_len_memory; max_seq_len "
        "still stops at them); one plan at a --seq-len past them is planned (what memory it "
        "takes) instead of refused",
    )
    lm.add_argument(
        "--fit-depth",
        action="store_true",
        help="profile copies with 4 and 8 decoder layers and extrapolate to the model's depth "
        "(every decoder layer alike), reporting the line's residual at 16 layers: a deep model "
        "searched in a fraction of the time",
    )


def add_adapter_arguments(parser: argparse.ArgumentParser) -> None:
    """``--lora`` and ``--quantize`` (``superneurons.memory.sizing.adapters``' grammar)."""
    adapters = parser.add_argument_group("adapters (--model hf:...)")
    adapters.add_argument(
        "--lora",
        default=None,
        metavar="r=R[,alpha=A,dropout=P,targets=all-linear|NAME,...,dtype=fp32|base]",
        help="train LoRA adapters (PEFT's LoraConfig; its defaults r=8, alpha=8, dropout 0, "
        "targets all-linear) with the base frozen; dtype: the adapters' (fp32: get_peft_model's "
        "default, base: the base's)",
    )
    adapters.add_argument(
        "--quantize",
        default=None,
        metavar="nf4[,double_quant=true|false,blocksize=64]|int8",
        help="with --lora: the frozen linear layers at bitsandbytes' storage (nf4: Linear4bit "
        "with double quantization, QLoRA's recipe; int8: Linear8bitLt)",
    )


def _add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """What the loop does around the optimizer step (``memory.plan.TrainingStep``)."""
    step = parser.add_argument_group("the training step")
    step.add_argument(
        "--max-grad-norm",
        type=float,
        default=0.0,
        help="the loop clips gradients to this global norm (0: no clipping, the default): an "
        "optimizer off the device then waits for the norm; the floors count it and "
        "step_costs says what it costs each strategy",
    )


def run(args: argparse.Namespace) -> int:
    request = request_of(args)
    if request.search is not None:
        return run_search(request, as_json=args.json)
    target = request.target
    if isinstance(target, LMTarget):
        size = f"{target.step.batch_size} x {target.step.seq_len}"
    else:
        size = f"batch {target.batch_size}"
    progress(f"profiling {args.model} {size} on fake tensors")
    found = plan_model(
        target,
        budget_bytes=request.budget_bytes,
        strategy=request.strategy,
        cost=request.cost,
        progress=progress,
    )
    record = found.to_dict()
    if args.json:
        print(json.dumps(record, indent=1))
    else:
        _print_floors(record)
    if found.plan is None:
        assert found.infeasible is not None
        raise found.infeasible
    if not args.json:
        _print_plan(record, found.plan)
    _check_host_budget(record, request.host_budget_bytes)
    return 0


def _check_host_budget(record: dict[str, Any], host_budget_bytes: int | None) -> None:
    """``--host-budget``: refuse a plan that needs more pinned host memory, with the figure."""
    needed = record.get("pinned_host_bytes", 0)
    if host_budget_bytes is None or needed <= host_budget_bytes:
        return
    raise ConfigError(
        f"the plan needs {format_bytes(needed)} of pinned host memory, above --host-budget "
        f"{format_bytes(host_budget_bytes)} (activations {format_bytes(record['host_bytes'])}, "
        f"optimizer {format_bytes(record['optimizer_host_bytes'])}, weights "
        f"{format_bytes(record['weights_host_bytes'])}): raise --host-budget or the device "
        "--budget"
    )


def _where(peak_at: dict[str, Any]) -> str:
    return f"{peak_at.get('unit') or '-'} ({peak_at.get('phase', '?')})"


def _print_floors(record: dict[str, Any]) -> None:
    what = f"{record['model']} batch {record['batch']}"
    if "seq_len" in record:
        what += f" x {record['seq_len']} tokens, {record['dtype']}"
        what += f" (autocast {record['autocast']})" if record["autocast"] else ""
        what += f", {record['optimizer']} ({record['optimizer_impl']}), {record['target_device']}"
        if record.get("beyond_positions"):
            what += f" (past the configuration's {record['max_positions']} positions)"
    print(f"{what}: eager peak {format_bytes(record['eager_peak_bytes'])}")
    print(
        f"  {'strategy':<26}{'floor':>12}  {'peak at':<30}{'host':>12}{'overhead':>12}"
        f"{'streamed':>12}"
    )
    for name, f in record["strategies"].items():
        host = f["pinned_host_bytes"]
        print(
            f"  {name:<26}{format_bytes(f['min_budget_bytes']):>12}  {_where(f['peak_at']):<30}"
            f"{format_bytes(host):>12}{f['predicted_overhead_s'] * 1e3:>9.2f} ms"
            f"{format_bytes(f['streamed_bytes']):>12}"
        )
    if record.get("feasible") is False:
        print(f"  budget {format_bytes(record['budget_bytes'])}: {record['message']}")
    if record.get("step_costs"):
        _print_step_costs(record)


def _print_step_costs(record: dict[str, Any]) -> None:
    print(f"  clipping to a global norm of {record['max_grad_norm']} costs each floor above:")
    for name, c in record["step_costs"].items():
        print(
            f"    {name:<26}{format_bytes(c['device_bytes']):>12} device "
            f"{format_bytes(c['host_bytes']):>12} host {c['overhead_s'] * 1e3:>9.2f} ms"
        )


def _print_plan(record: dict[str, Any], plan: Plan) -> None:
    print(f"budget {format_bytes(plan.budget_bytes)}, strategy {plan.strategy}")
    print(
        f"  predicted peak    {format_bytes(plan.predicted_peak_bytes)} at {_where(plan.peak_at)}"
    )
    print(
        "  breakdown         "
        + ", ".join(f"{k} {format_bytes(v)}" for k, v in plan.breakdown.items() if v)
    )
    print(f"  minimum budget    {format_bytes(plan.min_budget_bytes)}")
    print(
        f"  largest layer     {format_bytes(record['resident_bytes'])} resident + "
        f"{format_bytes(record['largest_unit_bytes'])} largest unit; floor / bound "
        f"{record['floor_over_largest_layer']:.3f}"
    )
    if plan.head is not None:
        print(
            f"  chunked           LM head + loss in chunks of {plan.head.chunk_tokens} tokens "
            f"({plan.head.mode}), block MLPs in {record['mlp_pieces']} sequence pieces"
        )
    norms = sum(1 for c in plan.seq_chunks if not c.fqn.endswith(".mlp"))
    if norms or plan.adapter_inputs:
        print(
            f"  narrow saves      {norms} fp32-computing norms in sequence pieces, "
            f"{len(plan.adapter_inputs)} LoRA layers keeping their input at the base's precision"
        )
    print(f"  host bytes        {format_bytes(plan.host_bytes)}")
    print(f"  pinned host       {format_bytes(record['pinned_host_bytes'])} in all")
    if plan.streams_weights:
        print(
            f"  streamed weights  {len(plan.streamed_units())} units, "
            f"{format_bytes(plan.weights_host_bytes)} on the host, "
            f"{format_bytes(plan.streamed_bytes)}/step over the link, "
            f"{plan.weights_exposed_s * 1e3:.2f} ms/step exposed"
        )
    print(f"  exposed copies    {plan.exposed_transfer_s * 1e3:.2f} ms/step (cost model)")
    print(f"  extra compute     {plan.extra_compute_s * 1e3:.2f} ms/step (cost model)")
    print(f"  transfers         {plan.transfer_s * 1e3:.2f} ms/step")
    print(
        f"  units             {record['units']}, recompute segments {record['segments']}, "
        f"optimizer in backward: {plan.optimizer_in_backward}"
    )
    if plan.optimizer_on_host:
        print(
            f"  optimizer state   {format_bytes(plan.optimizer_host_bytes)} in the host pool, "
            f"{plan.optimizer_copy_s * 1e3:.2f} ms/step of copies (both ways)"
        )
