"""The race: dense DDP and superneurons train for the same wall-clock budget over the same link.

Each arm is an ordinary ``superneurons train`` run (:mod:`superneurons.train`) with a clock:
``time_budget_s`` stops it after that many seconds of training and ``eval_every_s`` evaluates the
test split along the way (evaluations are not counted), so each arm leaves ``(train_s, test
accuracy)`` points in its ``metrics.jsonl``. Over a shaped link (:mod:`.link`) each rank is one
process started inside its own network namespace (``ip netns exec``; gloo over the veth pair,
one thread per rank); on loopback the trainer's own launcher (torchrun) starts them.

:func:`race_summary` reads the two curves: the time each arm needed to first reach dense's final
test accuracy (``time_to_dense_accuracy_ratio``: superneurons' time over dense's), the same for
dense's best accuracy (``time_to_dense_best_accuracy_ratio``: a few hundred test images make
dense's curve noisy, and a spike can reach its final accuracy long before it holds it), and each
arm's accuracy at the end of the common budget.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from superneurons.demo.link import DemoLink
from superneurons.errors import ConfigError
from superneurons.train.config import TrainConfig
from superneurons.train.launch import RANK_ENTRY, Launch, run_torchrun

__all__ = ["launch_arm", "race_summary", "time_to_accuracy_s"]

_PORT = 29500  # inside the demo's own namespaces: nothing else listens there
_GRACE_S = 600.0  # beyond the time budget, before ranks that never end are stopped


def launch_arm(train_config: TrainConfig, link: DemoLink, *, nproc: int, name: str) -> Path:
    """Run one arm's ranks to the end over ``link``; returns its output directory.

    Raises:
        ConfigError: a rank failed (its exit status named; its stderr is shown as it runs).
    """
    out = Path(train_config.out_dir)
    config_path = train_config.save(out / "config.json")
    if link.topology is None:
        status = run_torchrun(Launch(nproc=nproc), config_path)
        codes = [status]
    else:
        timeout_s = (train_config.time_budget_s or 0.0) * 3 + _GRACE_S
        codes = _run_in_namespaces(link, config_path, nproc=nproc, timeout_s=timeout_s)
    if any(codes):
        raise ConfigError(f"the {name} run failed (exit status {codes}); see above")
    return out


def _run_in_namespaces(
    link: DemoLink, config_path: Path, *, nproc: int, timeout_s: float
) -> list[int]:
    """One rank per namespace, meeting at rank 0's address (static rendezvous, the env://
    variables torchrun would set); every rank is stopped before this returns, also on Ctrl-C
    (the namespaces are deleted right after)."""
    topology = link.topology
    assert topology is not None
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(nproc):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": topology.addresses[0],
                "MASTER_PORT": str(_PORT),
                "GLOO_SOCKET_IFNAME": topology.interfaces[rank],
                "OMP_NUM_THREADS": "1",
            }
            argv = [sys.executable, "-m", RANK_ENTRY, str(config_path)]
            procs.append(subprocess.Popen([*topology.exec_prefix(rank), *argv], env=env))
        return _wait(procs, timeout_s=timeout_s)
    finally:  # never leave ranks running in namespaces about to be deleted
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _wait(procs: Sequence[subprocess.Popen[bytes]], *, timeout_s: float) -> list[int]:
    """Exit statuses; once one rank fails (or time is up) the others are stopped, since they
    would wait in a collective until gloo's timeout."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        failed = any(p.poll() not in (None, 0) for p in procs)
        if failed or time.monotonic() > deadline:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            break
        time.sleep(0.2)
    return [int(p.wait()) for p in procs]


def time_to_accuracy_s(evals: Sequence[Mapping[str, Any]], target: float) -> float | None:
    """``train_s`` of the first evaluation at or above ``target`` (None: never reached).

    The evaluations are points, so this is the time by which the accuracy was reached, an
    upper bound on the moment it was.
    """
    for record in evals:
        if record["test_accuracy"] >= target:
            return float(record["train_s"])
    return None


def race_summary(dense: Sequence[Mapping[str, Any]], ours: Sequence[Mapping[str, Any]]) -> dict:
    """The race's result from each arm's eval records (in order, the last one at the end of
    its time budget).

    ``time_to_dense_accuracy_ratio``: superneurons' time to dense's final test accuracy over
    dense's time to it (None where superneurons never reached it);
    ``time_to_dense_best_accuracy_ratio``: the same for dense's best accuracy along its curve;
    ``accuracy_delta_points``: superneurons' final accuracy less dense's, in percentage points.

    Raises:
        ConfigError: an arm has no evaluation (the run recorded no curve).
    """
    if not dense or not ours:
        raise ConfigError("each arm needs eval records (train with eval_every_s)")
    target = float(dense[-1]["test_accuracy"])
    dense_s = time_to_accuracy_s(dense, target)
    ours_s = time_to_accuracy_s(ours, target)
    assert dense_s is not None  # its own last point reaches it
    best = max(float(record["test_accuracy"]) for record in dense)
    dense_best_s = time_to_accuracy_s(dense, best)
    ours_best_s = time_to_accuracy_s(ours, best)
    assert dense_best_s is not None  # the point that holds it
    return {
        "dense_final_accuracy": target,
        "superneurons_final_accuracy": float(ours[-1]["test_accuracy"]),
        "accuracy_delta_points": 100.0 * (float(ours[-1]["test_accuracy"]) - target),
        "dense_train_s": float(dense[-1]["train_s"]),
        "superneurons_train_s": float(ours[-1]["train_s"]),
        "dense_time_to_accuracy_s": dense_s,
        "superneurons_time_to_accuracy_s": ours_s,
        "time_to_dense_accuracy_ratio": _ratio(ours_s, dense_s),
        "dense_best_accuracy": best,
        "dense_time_to_best_s": dense_best_s,
        "superneurons_time_to_dense_best_s": ours_best_s,
        "time_to_dense_best_accuracy_ratio": _ratio(ours_best_s, dense_best_s),
        "dense_steps": int(dense[-1]["step"]),
        "superneurons_steps": int(ours[-1]["step"]),
    }


def _ratio(ours_s: float | None, dense_s: float) -> float | None:
    """Superneurons' time over dense's; None where it never got there (or dense at once)."""
    return None if ours_s is None or dense_s <= 0 else ours_s / dense_s
