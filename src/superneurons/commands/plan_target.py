"""What ``superneurons plan`` plans, read once from its flags: the target (a zoo model or a
causal LM, :mod:`superneurons.memory.sizing.target`), the device (cost model and memory size)
and the budget. Shared by the one-plan report (:mod:`.plan`) and the largest-size searches
(:mod:`.plan_search`)."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, replace

from superneurons.bytesize import parse_bytes
from superneurons.errors import ConfigError
from superneurons.memory.planner.cost import CostModel, cost_model, with_host_link
from superneurons.memory.sizing.adapters import LoraSpec, QuantSpec, parse_lora, parse_quantize
from superneurons.memory.sizing.llm import (
    LMStep,
    default_optimizer_impl,
    load_config,
    max_positions,
    require_rotary_positions,
)
from superneurons.memory.sizing.search import LMSearch
from superneurons.memory.sizing.target import BELOW, HF, LMTarget, Target, ZooTarget
from superneurons.rates import parse_rate

__all__ = ["BELOW", "ZOO_BUDGET", "PlanRequest", "progress", "request_of"]

ZOO_BUDGET = "12GiB"  # the SuperNeurons experiments' card (a 12 GiB TITAN X)


@dataclass(frozen=True)
class PlanRequest:
    """``superneurons plan``'s flags, read once.

    Attributes:
        target: what is profiled.
        cost: the device's cost model (``--device-preset``, ``--bandwidth``).
        budget_bytes: the device budget.
        strategy: the planner's strategy (``auto``: its choice).
        search: ``"depth"``, ``"batch"`` or ``"seq_len"`` for ``--max-*``; None: one plan.
        lm_search: how a causal LM is searched (``--beyond-positions``, ``--fit-depth``).
        host_budget_bytes: ``--host-budget``: the pinned host memory a plan may need (None:
            unbounded).
    """

    target: Target
    cost: CostModel
    budget_bytes: int
    strategy: str
    search: str | None
    lm_search: LMSearch = LMSearch()
    host_budget_bytes: int | None = None


def request_of(args: argparse.Namespace) -> PlanRequest:
    """The target, the device, the budget and what to find, from the command line."""
    target = with_training_step(target_of(args), args)
    cost = device_cost(args)
    search = (
        "depth" if args.max_depth else "batch" if args.max_batch else "seq_len"
        if args.max_seq_len else None
    )  # fmt: skip
    lm_search = lm_search_of(args, search)
    if search is None and lm_search.beyond_positions:  # one plan past the positions
        target, lm_search = past_positions(target), LMSearch()
    budget_bytes = budget_bytes_of(args, target, cost)
    host_budget = getattr(args, "host_budget", None)
    return PlanRequest(
        target,
        cost,
        budget_bytes,
        args.strategy,
        search,
        lm_search=lm_search,
        host_budget_bytes=parse_bytes(host_budget) if host_budget is not None else None,
    )


def lm_search_of(args: argparse.Namespace, search: str | None) -> LMSearch:
    """``--beyond-positions`` (of ``--max-seq-len``, or of one plan at ``--seq-len``) and
    ``--fit-depth`` (of ``--max-seq-len`` / ``--max-batch``)."""
    options = LMSearch(
        beyond_positions=getattr(args, "beyond_positions", False),
        fit_depth=getattr(args, "fit_depth", False),
    )
    if options.fit_depth and search not in ("seq_len", "batch"):
        raise ConfigError("--fit-depth applies to --max-seq-len / --max-batch")
    if options.beyond_positions and search not in ("seq_len", "batch", None):
        raise ConfigError("--beyond-positions applies to --max-seq-len or one plan at --seq-len")
    return options


def past_positions(target: Target) -> LMTarget:
    """``target`` planned at its ``--seq-len`` even past the configuration's positions:
    a causal LM with rotary positions only (a table of positions cannot run a longer
    sequence at all)."""
    if not isinstance(target, LMTarget):
        raise ConfigError("--beyond-positions applies to --model hf:... only")
    require_rotary_positions(target.config)
    return replace(target, beyond_positions=True)


def target_of(args: argparse.Namespace) -> Target:
    """``--model`` and the flags that shape its step, parsed once: ``hf:NAME_OR_PATH`` is a
    causal LM from a configuration, anything else a zoo model."""
    if args.model.startswith(HF):
        return _lm_target(args, args.model[len(HF) :])
    if args.max_seq_len or args.seq_len is not None or args.autocast:
        raise ConfigError("--seq-len, --autocast and --max-seq-len apply to --model hf:... only")
    if getattr(args, "lora", None) or getattr(args, "quantize", None):
        raise ConfigError("--lora and --quantize apply to --model hf:... only")
    return ZooTarget(
        name=args.model,
        batch_size=16 if args.batch is None else args.batch,
        optimizer=args.optimizer or "sgd",
        granularity=args.granularity or "auto",
        image_size=args.image_size,
        depth=args.depth,
        preset=(args.preset or "gpt2") if args.model == "gpt" else None,
    )


def with_training_step(target: Target, args: argparse.Namespace) -> Target:
    """``target`` planned for the loop's training step (``--max-grad-norm``); a ``--max-*``
    search plans the plain step only."""
    max_grad_norm = getattr(args, "max_grad_norm", 0.0) or 0.0
    if not max_grad_norm:
        return target
    if args.max_depth or args.max_batch or args.max_seq_len:
        raise ConfigError("--max-grad-norm plans one step: leave out --max-depth/-batch/-seq-len")
    if not max_grad_norm > 0:
        raise ConfigError(f"--max-grad-norm must be >= 0, got {max_grad_norm}")
    return replace(target, max_grad_norm=max_grad_norm)


def _lm_target(args: argparse.Namespace, name: str) -> LMTarget:
    if (args.granularity or "block") != "block":
        raise ConfigError("hf: models are planned per block: leave --granularity out")
    config, source = load_config(name)
    limit = max_positions(config)
    target_device = args.target_device or ("cpu" if args.device_preset == "cpu" else "cuda")
    step = LMStep(
        seq_len=min(2048, limit or 2048) if args.seq_len is None else args.seq_len,
        batch_size=1 if args.batch is None else args.batch,
        dtype=args.dtype,
        autocast=args.autocast,
        optimizer=args.optimizer or "adamw",
        optimizer_impl=args.optimizer_impl or default_optimizer_impl(target_device),
        keep_outputs=args.keep_outputs,
        target_device=target_device,
        lora=lora_of(args),
        quantize=quantize_of(args),
    )
    return LMTarget(name, config, source, step, below=args.below)


def lora_of(args: argparse.Namespace) -> LoraSpec | None:
    """``--lora``, parsed once (:func:`superneurons.memory.sizing.adapters.parse_lora`)."""
    text = getattr(args, "lora", None)
    return None if text is None else parse_lora(text)


def quantize_of(args: argparse.Namespace) -> QuantSpec | None:
    """``--quantize``, parsed once (:func:`superneurons.memory.sizing.adapters.
    parse_quantize`)."""
    text = getattr(args, "quantize", None)
    return None if text is None else parse_quantize(text)


def progress(message: str) -> None:
    print(f"[plan] {message}", file=sys.stderr, flush=True)


def device_cost(args: argparse.Namespace) -> CostModel:
    """``--device-preset``, its copy rates replaced by ``--host-link``'s or ``--bandwidth``
    (both ways) if given."""
    link = getattr(args, "host_link", None)
    if link is not None:
        if args.bandwidth is not None:
            raise ConfigError("give --host-link or --bandwidth, not both")
        return with_host_link(cost_model(args.device_preset), link)
    rates = {}
    if args.bandwidth is not None:
        rate = bandwidth_bytes_per_s(args.bandwidth)
        rates = {"bandwidth_bytes_per_s": rate, "h2d_bytes_per_s": rate}
    return cost_model(args.device_preset, **rates)


def bandwidth_bytes_per_s(text: str) -> float:
    """``--bandwidth``: a rate as :func:`superneurons.rates.parse_rate` reads it (``100gbit``,
    ``12GB/s``), or a byte size taken as bytes per second (``12GB``, as the flag first read)."""
    if re.search(r"bit|/s", text, re.IGNORECASE):
        return parse_rate(text) / 8
    return float(parse_bytes(text))


def budget_bytes_of(args: argparse.Namespace, target: Target, cost: CostModel) -> int:
    """``--budget``; left out: the device preset's memory for a causal LM, else
    :data:`ZOO_BUDGET`."""
    if args.budget is not None:
        return parse_bytes(args.budget)
    if isinstance(target, ZooTarget):
        return parse_bytes(ZOO_BUDGET)
    if cost.memory_bytes <= 0:
        raise ConfigError(f"--device-preset {args.device_preset} has no memory size: give --budget")
    return cost.memory_bytes
