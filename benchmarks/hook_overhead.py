"""Per-step CPU time the compression hook adds on top of dense DDP.

One gloo rank (world size 1: the collective is a local copy, so what remains is the hook's own
work), one thread, the zoo's ``fc-heavy`` (29.9M parameters, 97% in one FC layer). For each
spec: ``steps`` timed steps after ``warmup`` untimed ones; per step the process CPU time and
the wall time of forward + backward + optimizer step. The hook's CPU time is a spec's CPU time
minus dense's in the same run. The codec's own time in an error-feedback step (encode + decode
for the residual + decode_sum, per parameter, outside any hook) is measured alongside: what the
hook adds beyond it is copies, error-feedback arithmetic and Python.

Run it under the bench lock (the machine is shared)::

    flock /tmp/superneurons-bench.lock nice -n 0 python benchmarks/hook_overhead.py \
        --specs dense,fft,topk --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from superneurons.compress import parse_spec, register_compression
from superneurons.models.zoo import build_model, model_input


def _step_times(ddp: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> list:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    out = []
    for _ in range(steps):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(batch[0]), batch[1]).backward()
        opt.step()
        out.append((time.process_time() - cpu0, time.perf_counter() - wall0))
    return out


def _codec_time(spec: str, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    """CPU seconds of the codec's own work in one error-feedback step, no hook: per parameter
    ``encode`` + ``decode`` (the residual) + ``decode_sum`` of one payload (world size 1)."""
    codec = parse_spec(spec)
    if not hasattr(codec, "encode"):
        return float("nan")
    model.zero_grad()
    nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
    grads = [p.grad.reshape(-1).clone() for p in model.parameters() if p.grad is not None]
    cpu0 = time.process_time()
    for g in grads:
        payload = codec.encode(g)
        codec.decode(payload)
        codec.decode_sum([payload])
    return time.process_time() - cpu0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--specs", default="dense,fft,topk")
    parser.add_argument("--model", default="fc-heavy")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the JSON record here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    dist.init_process_group("gloo", rank=0, world_size=1)
    batch = model_input(args.model, args.batch, generator=torch.Generator().manual_seed(0))
    rows = []
    for spec in args.specs.split(","):
        torch.manual_seed(0)
        model = build_model(args.model)
        ddp = DistributedDataParallel(model)
        register_compression(ddp, spec)
        _step_times(ddp, batch, args.warmup)
        times = _step_times(ddp, batch, args.steps)
        cpu = sorted(t[0] for t in times)[len(times) // 2]
        wall = sorted(t[1] for t in times)[len(times) // 2]
        codec_s = _codec_time(spec, model, batch) if spec != "dense" else 0.0
        torch.distributed.barrier()
        rows.append({"spec": spec, "cpu_s": cpu, "wall_s": wall, "codec_cpu_s": codec_s})
    dense = next((r for r in rows if r["spec"] == "dense"), None)
    print(f"model {args.model}, batch {args.batch}, median of {args.steps} steps, 1 thread")
    print(f"{'spec':<28} {'cpu s/step':>10} {'wall s/step':>11} {'hook cpu s':>10} {'codec s':>8}")
    # hook cpu s = cpu s/step - dense's; codec s = encode + decode + decode_sum outside the hook
    for r in rows:
        r["hook_cpu_s"] = r["cpu_s"] - dense["cpu_s"] if dense else float("nan")
        print(
            f"{r['spec']:<28} {r['cpu_s']:>10.3f} {r['wall_s']:>11.3f} "
            f"{r['hook_cpu_s']:>10.3f} {r['codec_cpu_s']:>8.3f}"
        )
    if args.out:
        record = {
            "command": " ".join([sys.executable, *sys.argv]),
            "machine": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    from superneurons.train.rank import exit_rank

    exit_rank(main())  # barrier, destroy, exit without racing gloo's threads
