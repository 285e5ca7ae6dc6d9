"""DDP with compressed gradients in your own training loop: one extra line.

Run on 2 processes (NCCL with a GPU per process, else gloo on CPU)::

    torchrun --nproc-per-node 2 examples/ddp_compression.py --compress fft:theta=0.9,bits=8

``register_compression`` replaces DDP's fp32 all-reduce by a codec (FFT sparsification with
range-based floats, Wang et al. HPDC'20; or topk, qsgd, terngrad, signsgd, fp16,
powersgd:rank=4, ...) with error feedback keyed by parameter name. Its state goes into your
checkpoint like the optimizer's.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from superneurons.compress import ErrorFeedback, Warmup, parse_spec, register_compression
from superneurons.train import exit_rank, init_distributed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compress", default="fft:theta=0.9,bits=8")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()

    torch.set_num_threads(1)
    # NCCL and cuda:LOCAL_RANK when every rank has a GPU, else gloo on CPU
    placement = init_distributed("auto")
    rank = dist.get_rank()
    torch.manual_seed(0)  # identical initial weights on every rank
    model = placement.module(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10)))
    ddp = DistributedDataParallel(model)
    # the one extra line: the codec with 5 dense warm-up steps and error feedback
    state = register_compression(ddp, ErrorFeedback(Warmup(parse_spec(args.compress), steps=5)))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    data = torch.Generator().manual_seed(rank)  # each rank sees its own data
    teacher = torch.Generator().manual_seed(1234)  # the same target function everywhere
    target_weights = torch.randn(32, 10, generator=teacher)
    for step in range(args.steps):
        inputs = torch.randn(64, 32, generator=data)
        labels = (inputs @ target_weights).argmax(dim=1)
        inputs, labels = placement.batch((inputs, labels))
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(ddp(inputs), labels)
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            ratio = state.dense_bytes_step / max(state.bytes_sent_step, 1)
            print(
                f"step {step:3d}  loss {loss.item():.3f}  sent {state.bytes_sent_step} B ({ratio:.1f}x less)"
            )

    checkpoint = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "compression": state.state_dict(),  # residuals by name, step, PowerSGD factors
    }
    if rank == 0:
        print(f"checkpoint keys: {sorted(checkpoint)}")


if __name__ == "__main__":
    main()
    # barrier, destroy the process group, exit without the interpreter's finaliser racing
    # gloo's worker threads (an abort after all work is done otherwise: pytorch#179291)
    exit_rank(0)
