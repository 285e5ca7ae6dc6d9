"""Plan keep / offload / recompute for a zoo model under a device byte budget.

Profiles one training step on fake tensors (no memory is used) and prints the plan:

    superneurons plan --model resnet --depth 590 --batch 16 --budget 12GiB
    superneurons plan --model gpt --batch 8 --budget 12GiB --optimizer adamw --json
    superneurons plan --model resnet --batch 16 --budget 11.4GiB --max-depth
    superneurons plan --model resnet50 --budget 12GiB --max-batch --strategy offload

``--max-depth`` / ``--max-batch`` search the largest ``[6, 32, n, 6]`` ResNet depth / batch whose
smallest predicted peak fits, per strategy (an affine fit over three profiled sizes; see
``superneurons.memory.simulate``). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from superneurons.bench.search import max_fitting, profile_for_strategy, zoo_peaks
from superneurons.bytesize import format_bytes, parse_bytes
from superneurons.errors import ConfigError
from superneurons.memory.bounds import largest_unit_bytes, resident_bytes
from superneurons.memory.cost import DEVICE_PRESETS, CostModel, cost_model
from superneurons.memory.plan import SEARCH_STRATEGIES, STRATEGIES, InfeasibleBudgetError
from superneurons.memory.planner import make_plan, strategy_floors
from superneurons.memory.profile_types import GRANULARITIES
from superneurons.memory.simulate import OPTIMIZERS, profile_zoo

HELP = "plan keep/offload/recompute per unit under a memory budget (fake tensors)"
DEPTH_SAMPLES = (24, 48, 72)  # stage-3 blocks n; the peak sits in stage 3 from n ~ 20 on
BATCH_SAMPLES = (4, 8, 16)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="resnet", help="zoo model (resnet, resnet50, gpt, ...)")
    parser.add_argument(
        "--depth", type=int, default=None, help="resnet depth (3n + 134 or 50/101/152)"
    )
    parser.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    parser.add_argument("--budget", default="12GiB", help="device budget, e.g. 12GiB, 11.4GiB")
    parser.add_argument("--strategy", default="auto", choices=STRATEGIES)
    parser.add_argument("--image-size", type=int, default=None, help="image side (default 224)")
    parser.add_argument("--optimizer", default="sgd", choices=tuple(OPTIMIZERS))
    parser.add_argument("--preset", default=None, help="gpt preset (default gpt2)")
    parser.add_argument(
        "--device-preset",
        default="a100",
        choices=tuple(DEVICE_PRESETS),
        help="device speeds of the cost model (memory.cost.DEVICE_PRESETS; default a100)",
    )
    parser.add_argument(
        "--bandwidth", default=None, help="host<->device bytes/s (default: the preset's)"
    )
    parser.add_argument(
        "--granularity",
        default="auto",
        choices=GRANULARITIES,
        help="units: blocks plus the rest of the step, every layer, or auto (default: blocks "
        "or the largest blocks split into layers, whichever gives the strategy a lower floor)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    search = parser.add_mutually_exclusive_group()
    search.add_argument("--max-depth", action="store_true", help="largest resnet depth that fits")
    search.add_argument("--max-batch", action="store_true", help="largest batch that fits")


def _model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
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


def _progress(message: str) -> None:
    print(f"[plan] {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    budget_bytes = parse_bytes(args.budget)
    if args.batch < 1:
        raise ConfigError(f"--batch must be >= 1, got {args.batch}")
    cost: CostModel = cost_model(args.device_preset)
    if args.bandwidth is not None:
        rate = float(parse_bytes(args.bandwidth))
        cost = cost_model(args.device_preset, bandwidth_bytes_per_s=rate, h2d_bytes_per_s=rate)
    kwargs = _model_kwargs(args)
    strategies = SEARCH_STRATEGIES if args.strategy == "auto" else (args.strategy,)
    if args.max_depth or args.max_batch:
        return _search(args, kwargs, strategies, budget_bytes, cost)
    _progress(f"profiling {args.model} batch {args.batch} on fake tensors")
    options = dict(batch_size=args.batch, optimizer=args.optimizer, **kwargs)
    if args.granularity == "auto":  # blocks, or the largest blocks split: the lower floor
        profile, granularity = profile_for_strategy(args.model, args.strategy, cost=cost, **options)
    else:
        profile = profile_zoo(args.model, granularity=args.granularity, **options)
        granularity = args.granularity
    record: dict[str, Any] = {"model": args.model, **kwargs, "batch": args.batch}
    record["granularity"] = granularity
    record["eager_peak_bytes"] = profile.predicted_peak_bytes()
    record["device_preset"] = args.device_preset
    # the largest-layer bound (SuperNeurons' claim): resident state + the largest working set
    # of one unit's forward + backward, next to the floor of the requested strategy
    floors = strategy_floors(profile, cost=cost)
    minima = {name: f.min_budget_bytes for name, f in floors.items()}
    floor = minima[args.strategy] if args.strategy in minima else min(minima.values())
    record["strategies"] = {name: f.to_dict() for name, f in floors.items()}
    record["resident_bytes"] = resident_bytes(profile)
    record["largest_unit_bytes"] = largest_unit_bytes(profile)
    record["floor_bytes"] = floor
    record["floor_over_largest_layer"] = floor / (
        record["resident_bytes"] + record["largest_unit_bytes"]
    )
    record["floor_over_eager"] = floor / record["eager_peak_bytes"]
    try:
        plan = make_plan(profile, budget_bytes=budget_bytes, strategy=args.strategy, cost=cost)
    except InfeasibleBudgetError as exc:
        record.update(
            feasible=False,
            strategy=args.strategy,
            budget_bytes=budget_bytes,
            min_budget_bytes=exc.min_budget_bytes,
            min_budget_strategy=exc.strategy,
            message=str(exc),
        )
        print(json.dumps(record, indent=1) if args.json else f"infeasible: {exc}")
        return 1
    record.update(
        feasible=plan.feasible,
        strategy=plan.strategy,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        min_budget_bytes=plan.min_budget_bytes,
        host_bytes=plan.host_bytes,
        extra_compute_s=plan.extra_compute_s,
        transfer_s=plan.transfer_s,
        optimizer_in_backward=plan.optimizer_in_backward,
        optimizer_on_host=plan.optimizer_on_host,
        optimizer_host_bytes=plan.optimizer_host_bytes,
        optimizer_copy_s=plan.optimizer_copy_s,
        peak_at=plan.peak_at,
        breakdown=plan.breakdown,
        units={a: plan.count(a) for a in ("keep", "offload", "recompute", "recompute+offload")},
        segments=len({u.segment for u in plan.units if u.segment >= 0}),
    )
    if args.json:
        print(json.dumps({**record, "plan": plan.to_dict()}, indent=1))
        return 0
    print(
        f"{args.model} batch {args.batch}: budget {format_bytes(budget_bytes)}, "
        f"strategy {plan.strategy}"
    )
    print(f"  eager peak        {format_bytes(record['eager_peak_bytes'])}")
    print(f"  predicted peak    {format_bytes(plan.predicted_peak_bytes)}")
    print(f"  minimum budget    {format_bytes(plan.min_budget_bytes)}")
    print(
        f"  largest layer     {format_bytes(record['resident_bytes'])} resident + "
        f"{format_bytes(record['largest_unit_bytes'])} largest unit; floor / bound "
        f"{record['floor_over_largest_layer']:.3f}"
    )
    print(f"  host bytes        {format_bytes(plan.host_bytes)}")
    print(f"  extra compute     {plan.extra_compute_s * 1e3:.2f} ms/step (cost model)")
    print(f"  transfers         {plan.transfer_s * 1e3:.2f} ms/step")
    print(
        f"  units             {record['units']}, recompute segments {record['segments']}, "
        "optimizer in backward: "
        f"{plan.optimizer_in_backward}"
    )
    if plan.optimizer_on_host:
        print(
            f"  optimizer state   {format_bytes(plan.optimizer_host_bytes)} in the host pool, "
            f"{plan.optimizer_copy_s * 1e3:.2f} ms/step of copies (both ways)"
        )
    return 0


def _search(
    args: argparse.Namespace,
    kwargs: dict[str, Any],
    strategies: tuple[str, ...],
    budget_bytes: int,
    cost: CostModel,
) -> int:
    from superneurons.models.resnet import n_to_depth

    kwargs.pop("depth", None)
    if args.max_depth:
        if args.model != "resnet":
            raise ConfigError("--max-depth searches the [6, 32, n, 6] family: use --model resnet")
        peaks = zoo_peaks(
            args.model, "n", cost=cost, optimizer=args.optimizer, batch_size=args.batch, **kwargs
        )
        sizes = DEPTH_SAMPLES
    else:
        peaks = zoo_peaks(args.model, "batch", cost=cost, optimizer=args.optimizer, **kwargs)
        sizes = BATCH_SAMPLES
    # NOTE: batches are verified by direct profiles (cheap); depths trust the affine fit,
    # which is exact once stage 3 holds the peak (validated in `superneurons bench deeper`).
    fits = max_fitting(
        peaks,
        strategies,
        budget_bytes=budget_bytes,
        sizes=sizes,
        progress=_progress,
        verify=bool(args.max_batch),
    )
    records = []
    for strategy, fit in fits.items():
        record: dict[str, Any] = {
            "strategy": strategy,
            "model": args.model,
            "budget_bytes": budget_bytes,
            "fit_residual": fit.residual,
            "slope_bytes": fit.slope_bytes,
            "intercept_bytes": fit.intercept_bytes,
        }
        if args.max_depth:
            record.update(
                max_depth=n_to_depth(fit.size) if fit.size else 0, n=fit.size, batch=args.batch
            )
        else:
            record.update(max_batch=fit.size)
        records.append(record)
    if args.json:
        print(json.dumps(records[0] if len(records) == 1 else records, indent=1))
    else:
        key = "max_depth" if args.max_depth else "max_batch"
        for r in records:
            print(f"{r['strategy']:<26} {key} {r[key]:>6}   (fit residual {r['fit_residual']:.2%})")
    return 0
