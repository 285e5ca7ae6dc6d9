"""Does auto's whole-step prediction add up? Per dense observation step of `auto` on the
network bench's ResNet (Fashion-MNIST, 2 gloo ranks on loopback): forward end -> last bucket
averaged, averaged -> next forward end (`outside_s`), and the loop's own step time.

    PYTHONPATH=src python benchmarks/auto_step_split.py
"""

import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, "tests")
from distributed import run_ranks


def one(rank, world):
    torch.set_num_threads(1)
    from superneurons.bench.network.data import bench_batches
    from superneurons.compress import register_compression
    from superneurons.models import build_model, default_loss

    kw = {"depth": 18, "small_input": True, "in_channels": 1, "num_classes": 10, "width": 32}
    torch.manual_seed(0)
    model = build_model("resnet", **kw)
    batches, _ = bench_batches(
        model,
        "resnet",
        kw,
        data="real",
        root="/usr/share/datasets/fashion-mnist",
        batch_size=32,
        seed=0,
        rank=rank,
        world_size=world,
    )
    ddp = DistributedDataParallel(model)
    state = register_compression(ddp, "auto:observe_steps=6")
    auto = state.auto
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    loss_fn = default_loss("resnet")
    loop = []
    snap = None
    for _step in range(9):
        t = time.perf_counter()
        x, y = next(batches)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        loop.append(time.perf_counter() - t)
        if auto.assignment is None:
            snap = (list(auto._ready), list(auto._ends))
    ready, ends = snap
    t0 = {s: t for s, _k, _n, _m, t, _mk in ready}
    rows = []
    for s, t0s, end in ends:
        rows.append((s, end - t0s, (t0[s + 1] - end) if s + 1 in t0 else None))
    a = auto.assignment
    return {
        "loop": loop,
        "rows": rows,
        "outside": a.outside_s,
        "pred": a.predicted_step_s,
        "reason": a.reason,
    }


if __name__ == "__main__":
    r = run_ranks(one, world_size=2, timeout_s=600)[0]
    print("loop step s:", [round(v, 3) for v in r["loop"]])
    for step, averaged_s, outside_s in r["rows"]:
        after = "-" if outside_s is None else f"{outside_s:.3f}"
        print(f"step {step}  t0->averaged {averaged_s:.3f}  averaged->next t0 {after}")
    print("outside_s", round(r["outside"], 3), "pred", round(r["pred"], 3), r["reason"])
