"""The DDP hook's results, bit for bit, in two source trees: a change to the hook or the codecs
that claims to move no bit is checked on a real training run, not only on payloads.

Two gloo ranks on loopback, a 1.1M-parameter MLP in several 1 MiB buckets (so the two-phase
all-gather of one bucket waits for the next bucket's hook), SGD for 5 steps with error feedback
(``register_compression(ddp, spec)``); per spec and tree, the SHA-256 of rank 0's parameters::

    python benchmarks/hook_identity.py --arm after=src --arm before=/tmp/before/src \\
        --out benchmarks/results/hook_identity
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

SPECS = (
    "twophase:bits=4;twophase:bits=1;twophase:bits=2,rounding=stochastic;"
    "twophase:bits=8,transform=hadamard;twophase:bits=32;ctopk;fft;topk;qsgd;fp16;"
    "powersgd:rank=4"
)


def worker(rank: int, spec: str) -> NoReturn:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from superneurons.compress import register_compression
    from superneurons.train import exit_rank

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 300), nn.ReLU(),
        nn.Linear(300, 10),
    )  # fmt: skip
    ddp = DistributedDataParallel(model, bucket_cap_mb=1)
    register_compression(ddp, spec)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(5):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(32, 1, 28, 28, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().view(torch.int32).numpy().tobytes())
    if rank == 0:
        print(digest.hexdigest(), flush=True)
    exit_rank(0)  # barrier, destroy, os._exit while the model is alive (superneurons.train.rank)


def _digest(src: str, spec: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()), OMP_NUM_THREADS="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(random.randint(20000, 30000)))
    cmd = [sys.executable, __file__, "--worker", spec]
    procs = [
        subprocess.Popen([*cmd, "--rank", str(r)], env=env, stdout=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{spec} on {src}: ranks exited {[p.returncode for p in procs]}")
    return outs[0].strip().splitlines()[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arm", action="append", default=[], help="NAME=SRC (repeatable)")
    parser.add_argument("--specs", default=SPECS, help="';'-separated specs")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.rank, args.worker)
        return 0
    import bench_record

    arms = bench_record.arms(args.arm or ["after=src"])
    rows = []
    for spec in [s for s in args.specs.split(";") if s]:
        row = {"spec": spec} | {arm: _digest(src, spec)[:16] for arm, src in arms.items()}
        row["identical"] = len({row[arm] for arm in arms}) == 1
        rows.append(row)
        print(row, flush=True)
    if args.out is not None:
        same = sum(r["identical"] for r in rows)
        body = (
            f"Rank 0's parameters after 5 SGD steps with error feedback, 2 gloo ranks, several "
            f"1 MiB buckets; first 16 hex digits of their SHA-256. **{same}/{len(rows)} specs "
            "identical across the trees.**\n\n" + bench_record.markdown_table(rows, list(rows[0]))
        )
        bench_record.write(
            args.out, "hook_identity", "The hook's results in two trees, bit for bit", body,
            {"arms": arms, "rows": rows},
        )  # fmt: skip
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
