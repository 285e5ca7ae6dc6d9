"""``superneurons plan --max-depth / --max-batch / --max-seq-len``: the largest size that fits.

Per strategy, an affine fit of the smallest predicted peak over three profiled sizes, solved for
the budget (:func:`superneurons.memory.sizing.search.max_fitting`); batches and sequence lengths are
then checked by direct profiles (``verify``). Sequence lengths are searched in multiples of
:data:`SEQ_QUANTUM` tokens (a quarter of the positions for configurations with fewer than 4 x
that) and stop at the configuration's positions: nothing beyond them is profiled.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from superneurons.commands.plan_target import BELOW, HF, lm_target, progress, zoo_kwargs
from superneurons.errors import ConfigError
from superneurons.memory.planner.cost import CostModel
from superneurons.memory.sizing.llm import max_positions
from superneurons.memory.sizing.search import lm_peaks, max_fitting, zoo_peaks

__all__ = ["SEQ_QUANTUM", "run_search"]

DEPTH_SAMPLES = (24, 48, 72)  # stage-3 blocks n; the peak sits in stage 3 from n ~ 20 on
BATCH_SAMPLES = (4, 8, 16)
SEQ_QUANTUM = 256  # --max-seq-len answers in multiples of this many tokens


def run_search(
    args: argparse.Namespace, strategies: tuple[str, ...], budget_bytes: int, cost: CostModel
) -> int:
    """``--max-depth`` / ``--max-batch`` / ``--max-seq-len``: the largest size per strategy."""
    if args.model.startswith(HF):
        if args.max_depth:
            raise ConfigError("--max-depth searches the [6, 32, n, 6] ResNet family")
        config, step, base = lm_target(args)
        axis, key = ("seq_len", "max_seq_len") if args.max_seq_len else ("batch", "max_batch")
        limit = max_positions(config) if args.max_seq_len else None
        quantum = SEQ_QUANTUM if args.max_seq_len else 1
        if limit is not None and limit < 4 * SEQ_QUANTUM:  # a small configuration: 4 samples
            quantum = max(limit // 4, 1)
        below = BELOW[args.below]
        peaks = lm_peaks(config, step, axis, cost=cost, quantum=quantum, variants=below)
        top = (limit or 64 * SEQ_QUANTUM) // quantum if args.max_seq_len else 8
        sizes = (max(top // 4, 1), max(top // 2, 2), max(top, 3))
        fits = max_fitting(
            peaks,
            strategies,
            budget_bytes=budget_bytes,
            sizes=sizes,
            progress=progress,
            verify=True,
            limit=limit // quantum if limit is not None else None,
        )
        records: list[dict[str, Any]] = []
        for strategy, fit in fits.items():
            size = fit.size * quantum
            found = {"strategy": strategy, **base, key: size, "budget_bytes": budget_bytes}
            found["below"] = args.below
            if limit is not None:  # the answer is the configuration's positions
                found["limited_by_positions"] = size + quantum > limit
            found.update(fit_residual=fit.residual, slope_bytes=fit.slope_bytes)
            found.update(intercept_bytes=fit.intercept_bytes, device_preset=args.device_preset)
            records.append(found)
        return _print_search(args, records, key)
    if args.max_seq_len:
        raise ConfigError("--max-seq-len applies to --model hf:... only")
    from superneurons.models.resnet import n_to_depth

    kwargs = zoo_kwargs(args)
    kwargs.pop("depth", None)
    optimizer = args.optimizer or "sgd"
    if args.max_depth:
        if args.model != "resnet":
            raise ConfigError("--max-depth searches the [6, 32, n, 6] family: use --model resnet")
        batch = args.batch or 16
        peaks = zoo_peaks(
            args.model, "n", cost=cost, optimizer=optimizer, batch_size=batch, **kwargs
        )
        sizes = DEPTH_SAMPLES
    else:
        peaks = zoo_peaks(args.model, "batch", cost=cost, optimizer=optimizer, **kwargs)
        sizes = BATCH_SAMPLES
    # NOTE: batches are verified by direct profiles (cheap); depths trust the affine fit,
    # which is exact once stage 3 holds the peak (validated in `superneurons bench deeper`).
    fits = max_fitting(
        peaks,
        strategies,
        budget_bytes=budget_bytes,
        sizes=sizes,
        progress=progress,
        verify=bool(args.max_batch),
    )
    rows: list[dict[str, Any]] = []
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
                max_depth=n_to_depth(fit.size) if fit.size else 0, n=fit.size, batch=batch
            )
        else:
            record.update(max_batch=fit.size)
        rows.append(record)
    return _print_search(args, rows, "max_depth" if args.max_depth else "max_batch")


def _print_search(args: argparse.Namespace, records: list[dict[str, Any]], key: str) -> int:
    if args.json:
        print(json.dumps(records[0] if len(records) == 1 else records, indent=1))
        return 0
    for r in records:
        note = " (the configuration's positions)" if r.get("limited_by_positions") else ""
        print(
            f"{r['strategy']:<26} {key} {r[key]:>7}{note}   (fit residual {r['fit_residual']:.2%})"
        )
    return 0
