"""Side-by-side wall and CPU time of DDP's own all-reduce and all-reduce through Python comm hooks.

A diagnostic for benchmarks/results/network/auto/README.md: 2 gloo ranks on loopback, the zoo's
fc-heavy, median of 5 steps after 4 untimed ones, in the order given on the command line (so
modes measured back to back share the machine's momentary load):

    PYTHONPATH=src:tests python benchmarks/ddp_hook_gap.py none minimal identity auto none

``none``: no hook (DDP's C++ all-reduce); ``minimal``: PyTorch's allreduce hook pattern in Python;
``identity``: ``register_compression(ddp, IdentityCodec())``; ``auto``: ``auto`` after its decision
(all dense on loopback). Prints ``mode [(wall s, cpu s) per rank]``.
"""

import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed import run_ranks


def minimal_hook(state, bucket):
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


def one(rank, ws, mode):
    from superneurons.compress import IdentityCodec, register_compression
    from superneurons.models.zoo import build_model, model_input

    torch.manual_seed(0)
    model = build_model("fc-heavy")
    ddp = DistributedDataParallel(model)
    if mode == "identity":
        register_compression(ddp, IdentityCodec())
    elif mode == "minimal":
        ddp.register_comm_hook(None, minimal_hook)
    elif mode == "auto":
        register_compression(ddp, "auto:observe_steps=1,drift=1000.0")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = model_input("fc-heavy", 32, generator=torch.Generator().manual_seed(rank))

    def step():
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    for _ in range(4):
        step()
    dist.barrier()
    walls, cpus = [], []
    for _ in range(5):
        c0, w0 = time.process_time(), time.perf_counter()
        step()
        dist.barrier()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return sorted(walls)[2], sorted(cpus)[2]


if __name__ == "__main__":
    for mode in sys.argv[1:]:
        print(mode, run_ranks(one, mode, world_size=2, timeout_s=600), flush=True)
