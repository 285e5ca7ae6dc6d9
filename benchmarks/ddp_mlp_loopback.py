"""Compressed DDP on two gloo ranks over loopback: per-step wall and rank 0's CPU time, per spec,
for one or more source trees side by side (the "before" and "after" of a change).

The model is a 28.4M-parameter MLP (784 -> 4096 -> 4096 -> 2048 -> 10, fp32, the zoo's ``mlp``
with wider hidden layers), trained by SGD on random 28x28 inputs, batch 64, one thread per rank,
``register_compression(ddp, spec)``. On loopback the bytes cost almost nothing, so what a spec
adds over ``dense`` is the CPU time of its codec and hook: "over dense" below is a spec's rank-0
CPU time per step minus dense's from the same tree in the same round.

    python benchmarks/ddp_mlp_loopback.py --arm after=src --arm before=/tmp/before/src \
        --rounds 3 --out benchmarks/results/ddp_mlp_loopback

Each (round, spec, arm) is a fresh pair of rank processes (``PYTHONPATH`` = the arm's tree);
arms alternate within a round so that they share the machine's momentary load. Rank 0 reports
the median over the timed steps of the wall time (``perf_counter``) and of the process CPU time
(``process_time``: this rank's own thread and gloo's threads; immune to other processes' load
as far as CPU time can be). The table gives, per (arm, spec), the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

SPECS = "dense;torch-fp16;twophase:bits=4;ctopk;fft:theta=0.9,bits=8"
HIDDEN = (4096, 4096, 2048)


def _port() -> int:
    for _ in range(50):
        port = random.randint(20000, 30000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def worker(rank: int, spec: str, args: argparse.Namespace) -> NoReturn:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from superneurons.compress import register_compression
    from superneurons.models.zoo import build_model
    from superneurons.train import exit_rank

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = build_model("mlp", hidden=HIDDEN)
    ddp = DistributedDataParallel(model)
    register_compression(ddp, spec)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    steps, warmup = args.steps, args.warmup
    walls, cpus = [], []
    profiler = None
    if args.profile and rank == 0:
        import cProfile

        profiler = cProfile.Profile(timer=time.process_time)
    for step in range(warmup + steps):
        dist.barrier()
        if profiler is not None and step == warmup:
            profiler.enable()
        wall0, cpu0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        if step >= warmup:
            walls.append(time.perf_counter() - wall0)
            cpus.append(time.process_time() - cpu0)
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
        stats.print_stats(args.profile)
        sys.stderr.write(f"PROFILE {spec}\n{text.getvalue()}")
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(
            json.dumps(
                {
                    "params": params,
                    "wall_s": statistics.median(walls),
                    "cpu_s": statistics.median(cpus),
                    "walls": walls,
                    "cpus": cpus,
                }
            ),
            flush=True,
        )
    exit_rank(0)  # barrier, destroy, os._exit while the model is alive (superneurons.train.rank)


def run_pair(src: str, spec: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()), OMP_NUM_THREADS="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    cmd = [sys.executable, __file__, "--worker", spec]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]
    cmd += ["--profile", str(args.profile)]
    procs = [
        subprocess.Popen([*cmd, "--rank", str(rank)], env=env, stdout=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{spec} on {src}: ranks exited {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arm", action="append", default=[], help="NAME=SRC (repeatable)")
    parser.add_argument("--specs", default=SPECS, help="';'-separated (specs contain commas)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--profile", type=int, default=0, help="rank 0: print the N top functions (cProfile)"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.rank, args.worker, args)
        return 0
    import bench_record

    arms = bench_record.arms(args.arm or ["after=src"])
    specs = [s for s in args.specs.split(";") if s]
    runs = []
    for round_ in range(args.rounds):
        for spec in specs:
            for arm, src in arms.items():
                load = bench_record.load_average()
                result = run_pair(src, spec, args)
                runs.append({"round": round_, "arm": arm, "spec": spec, "load": load, **result})
                print(
                    f"round {round_} {arm:>7} {spec:<24} wall {result['wall_s'] * 1e3:7.0f} ms "
                    f"cpu {result['cpu_s'] * 1e3:7.0f} ms  load {load}",
                    flush=True,
                )
    rows = _summary(runs, arms, specs)
    print(bench_record.markdown_table(rows, list(rows[0])))
    if args.out is not None:
        body = (
            "Two gloo ranks on loopback, a 28.4M-parameter MLP (784-4096-4096-2048-10), SGD, "
            f"batch {args.batch}, one thread per rank, {args.warmup} untimed then {args.steps} "
            f"timed steps, {args.rounds} rounds (arms alternate within a round). Per (arm, "
            "spec): the median over rounds of each run's median step. `over dense` = rank-0 "
            "CPU ms per step minus dense's from the same arm. Load averages per run are in the "
            "JSON (`runs[].load`).\n\n" + bench_record.markdown_table(rows, list(rows[0]))
        )
        record = {"arms": arms, "specs": specs, "args": vars(args) | {"out": str(args.out)}}
        bench_record.write(
            args.out, "ddp_mlp_loopback", "Compressed DDP, 2 gloo ranks on loopback, 28.4M MLP",
            body, record | {"rows": rows, "runs": runs},
        )  # fmt: skip
        _plot(rows, arms, specs, args.out / "ddp_mlp_loopback.png")
    return 0


def _plot(rows: list[dict], arms: dict[str, str], specs: list[str], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(arms)
    for k, arm in enumerate(arms):
        got = {r["spec"]: r["over dense ms"] for r in rows if r["arm"] == arm}
        ax.bar(
            [i + k * width for i in range(len(specs))], [got[s] for s in specs], width, label=arm
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(specs))], specs, rotation=20)
    ax.set_ylabel("rank-0 CPU ms per step over dense")
    ax.set_title("2 gloo ranks, loopback, 28.4M-parameter MLP")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _summary(runs: list[dict], arms: dict[str, str], specs: list[str]) -> list[dict]:
    rows = []
    for arm in arms:
        dense = [r["cpu_s"] for r in runs if r["arm"] == arm and r["spec"] == "dense"]
        dense_cpu = statistics.median(dense) if dense else float("nan")
        for spec in specs:
            mine = [r for r in runs if r["arm"] == arm and r["spec"] == spec]
            wall = statistics.median(r["wall_s"] for r in mine)
            cpu = statistics.median(r["cpu_s"] for r in mine)
            rows.append(
                {
                    "arm": arm,
                    "spec": spec,
                    "wall ms": wall * 1e3,
                    "rank-0 cpu ms": cpu * 1e3,
                    "over dense ms": (cpu - dense_cpu) * 1e3,
                    "cpu ms per round": " / ".join(f"{r['cpu_s'] * 1e3:.0f}" for r in mine),
                }
            )
    return rows


if __name__ == "__main__":
    sys.exit(main())
