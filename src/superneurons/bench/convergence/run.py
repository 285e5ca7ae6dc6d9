"""The convergence benchmark: does a codec reach dense DDP's accuracy in the same steps?

:func:`run_convergence_bench` trains every (task, label) of a :class:`.config.ConvergenceConfig`
on ``nproc`` gloo ranks (:mod:`.rank`), forked on loopback from a server that imported torch
once (:func:`~superneurons.train.launch.forkserver_for_ranks`) or, with ``bandwidth_bit_s``,
each in its own network namespace behind a shaped link (:mod:`.shaped`), and returns rank 0's
records with ``delta_vs_dense`` filled in. Each record holds the final metric, its delta to
dense, the bytes vs dense, step times and the curve for the plot; labels are described in
:mod:`.labels`.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from superneurons.bench.convergence.config import ConvergenceConfig
from superneurons.bench.convergence.rank import rank_main
from superneurons.train.launch import forkserver_for_ranks, free_port

__all__ = ["add_deltas", "run_convergence_bench"]

log = logging.getLogger("superneurons.bench.convergence")

Progress = Callable[[str], None]


def run_convergence_bench(
    config: ConvergenceConfig, *, progress: Progress | None = None
) -> list[dict[str, Any]]:
    """Train every (task, codec); returns records with ``delta_vs_dense`` filled in."""
    import torch.multiprocessing as mp

    say = progress or log.info
    expected = sum(lb.on(t.optimizer) is not None for t in config.tasks for lb in config.labels)
    with tempfile.TemporaryDirectory(prefix="sn-convergence-") as tmp:
        out = Path(tmp) / "records.jsonl"
        seen = 0

        def poll() -> None:
            nonlocal seen
            lines = out.read_text().splitlines() if out.exists() else []
            for line in lines[seen:]:
                say(_describe(json.loads(line), len(lines), expected))
            seen = len(lines)

        if config.bandwidth_bit_s is not None:
            from superneurons.bench.convergence.shaped import run_ranks_shaped

            run_ranks_shaped(config, out, poll)
        else:
            forkserver_for_ranks("superneurons.bench.convergence.rank")  # ranks fork from it
            ctx = mp.start_processes(
                rank_main,
                args=(config, free_port(), str(out)),
                nprocs=config.nproc,
                join=False,
                start_method="forkserver",
            )
            while not ctx.join(timeout=1.0):
                poll()
        poll()
        lines = out.read_text().splitlines() if out.exists() else []
        records = [json.loads(line) for line in lines]
    add_deltas(records)
    return records


def _describe(record: dict[str, Any], done: int, expected: int) -> str:
    return (
        f"[{done}/{expected}] {record['task']} {record['codec']}: {record['metric']} "
        f"{record['final_metric']:.3f} ({record['steps']} steps, {record['wall_s']:.0f} s)"
    )


def add_deltas(records: Sequence[dict[str, Any]]) -> None:
    """``delta_vs_dense`` = final metric - dense's final metric on the same task (points of
    accuracy, or nats of loss: lower loss is better)."""
    dense = {r["task"]: r["final_metric"] for r in records if r["codec"] == "dense"}
    for record in records:
        base = dense.get(record["task"])
        record["delta_vs_dense"] = None if base is None else record["final_metric"] - base
