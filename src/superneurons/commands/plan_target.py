"""What ``superneurons plan`` plans, read from its flags: the zoo model or the causal LM, the
device (cost model and memory size) and the budget. Shared by the one-plan report
(:mod:`.plan`) and the largest-size searches (:mod:`.plan_search`)."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from superneurons.bytesize import parse_bytes
from superneurons.errors import ConfigError
from superneurons.memory.planner.cost import CostModel, cost_model
from superneurons.memory.profiling.below import VARIANTS
from superneurons.memory.sizing.llm import (
    BELOW_FLOOR,
    LM_OPTIMIZERS,
    LMStep,
    default_optimizer_impl,
    load_config,
    max_positions,
)
from superneurons.rates import parse_rate

__all__ = [
    "BELOW",
    "HF",
    "ZOO_BUDGET",
    "budget_bytes_of",
    "device_cost",
    "lm_target",
    "progress",
    "zoo_kwargs",
]

HF = "hf:"
ZOO_BUDGET = "12GiB"
# ``--below``: which ``memory.below.VARIANTS`` ``plan --model hf:`` profiles besides the plain step
BELOW: dict[str, tuple[str, ...]] = {
    "floor": BELOW_FLOOR,
    "all": VARIANTS,
    "off": (),
}  # the SuperNeurons experiments' card (a 12 GiB TITAN X)


def zoo_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if args.image_size is not None:
        kwargs["image_size"] = args.image_size
    if args.model == "resnet" and args.depth is not None:
        kwargs["depth"] = args.depth
    elif args.depth is not None:
        raise ConfigError("--depth applies to --model resnet only; use resnet50/101/152 by name")
    if args.model == "gpt":
        kwargs["preset"] = args.preset or "gpt2"
    return kwargs


def progress(message: str) -> None:
    print(f"[plan] {message}", file=sys.stderr, flush=True)


def device_cost(args: argparse.Namespace) -> CostModel:
    if args.bandwidth is None:
        return cost_model(args.device_preset)
    rate = bandwidth_bytes_per_s(args.bandwidth)
    return cost_model(args.device_preset, bandwidth_bytes_per_s=rate, h2d_bytes_per_s=rate)


def bandwidth_bytes_per_s(text: str) -> float:
    """``--bandwidth``: a rate as :func:`superneurons.rates.parse_rate` reads it (``100gbit``,
    ``12GB/s``), or a byte size taken as bytes per second (``12GB``, as the flag first read)."""
    if re.search(r"bit|/s", text, re.IGNORECASE):
        return parse_rate(text) / 8
    return float(parse_bytes(text))


def budget_bytes_of(args: argparse.Namespace, cost: CostModel) -> int:
    if args.budget is not None:
        return parse_bytes(args.budget)
    if not args.model.startswith(HF):
        return parse_bytes(ZOO_BUDGET)
    if cost.memory_bytes <= 0:
        raise ConfigError(f"--device-preset {args.device_preset} has no memory size: give --budget")
    return cost.memory_bytes


def lm_target(args: argparse.Namespace) -> tuple[Any, LMStep, dict[str, Any]]:
    """The configuration, the step and its record fields of ``--model hf:...``."""
    name = args.model[len(HF) :]
    config, source = load_config(name)
    limit = max_positions(config)
    seq_len = args.seq_len or min(2048, limit or 2048)
    target = args.target_device or ("cpu" if args.device_preset == "cpu" else "cuda")
    optimizer = args.optimizer or "adamw"
    if optimizer not in LM_OPTIMIZERS:
        raise ConfigError(f"--optimizer for hf: models is one of {', '.join(LM_OPTIMIZERS)}")
    step = LMStep(
        seq_len=seq_len,
        batch_size=args.batch or 1,
        dtype=args.dtype,
        autocast=args.autocast,
        optimizer=optimizer,
        optimizer_impl=args.optimizer_impl or default_optimizer_impl(target),
        keep_outputs=args.keep_outputs,
        target_device=target,
    )
    if limit is not None and seq_len > limit:
        raise ConfigError(
            f"--seq-len {seq_len} is beyond the {limit} positions of hf:{name} "
            "(max_position_embeddings): use --seq-len <= that"
        )
    record = {
        "model": args.model,
        "config_source": source,
        "seq_len": step.seq_len,
        "batch": step.batch_size,
        "dtype": step.dtype,
        "autocast": step.autocast,
        "optimizer": step.optimizer,
        "optimizer_impl": step.optimizer_impl,
        "target_device": step.target_device,
        "keep_outputs": step.keep_outputs,
        "max_positions": limit,
    }
    return config, step, record
