"""Does ``auto``'s one-shot error budget judge PowerSGD and top-k by what training sees?

``auto:max_rel_error=0.5`` excludes every candidate whose one-shot ``‖ĝ−g‖/‖g‖`` on a real
gradient exceeds 0.5. With error feedback (the default for ``auto``) what is dropped is sent
later, so training sees far less than the one-shot error (Stich et al. NeurIPS'18, Vogels et
al. NeurIPS'19). This script measures both on the network benchmark's ResNet-18 (width 32,
1 channel, 10 classes) on Fashion-MNIST, 2 gloo ranks on loopback, the same steps, data order
and initial weights for every codec:

* the one-shot relative error of each candidate as auto measures it (``measure_codecs`` on
  the largest gradient after a few dense steps);
* the test accuracy (first 2000 test images) and mean training loss of the last 20 steps
  after ``STEPS`` steps of SGD (momentum 0.9) with each codec under error feedback.

    PYTHONPATH=src:tests python benchmarks/auto_error_budget.py OUT.json dense powersgd:rank=4 ...

``STEPS=400`` (environment; default 100) sets the horizon. ``SEEDS=0,1,2`` (default ``0``) repeats every codec for each seed: the seed sets
the initial weights, the data order and the codecs' own seed. ``ONE_SHOT=0`` skips the one-shot
errors. ``torch-powersgd`` runs in one bucket (its hook is not multi-bucket safe on gloo).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed import run_ranks

STEPS = int(os.environ.get("STEPS", "100"))
BATCH, LR, TEST = 32, 0.05, 2000
MODEL = {"depth": 18, "small_input": True, "in_channels": 1, "num_classes": 10, "width": 32}


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from superneurons.data import fashion_mnist

    train = fashion_mnist("/usr/share/datasets/fashion-mnist", "train").tensors
    test = fashion_mnist("/usr/share/datasets/fashion-mnist", "test").tensors
    return train[0], train[1], test[0][:TEST], test[1][:TEST]


def _model(seed: int = 0) -> nn.Module:
    from superneurons.models.zoo import build_model

    torch.manual_seed(seed)
    return build_model("resnet", **MODEL)


def one(rank: int, world_size: int, spec: str, seed: int = 0) -> dict:
    torch.set_num_threads(1)
    from superneurons.compress import register_compression

    x, y, x_test, y_test = _data()
    model = _model(seed)
    # NOTE: torch's PowerSGD hook issues a collective from a future callback: one bucket on gloo.
    cap_mb = 1000 if spec.startswith("torch-powersgd") else 25
    ddp = DistributedDataParallel(model, bucket_cap_mb=cap_mb)
    if spec != "dense":
        register_compression(ddp, spec, seed=seed)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1 + seed))
    losses = []
    start = time.process_time()
    for step in range(STEPS):
        at = (step * world_size + rank) * BATCH
        idx = order[at % (x.shape[0] - BATCH) :][:BATCH]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x[idx].float()), y[idx])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    cpu_s = time.process_time() - start
    model.eval()
    with torch.no_grad():
        correct = sum(
            int((model(x_test[i : i + 500].float()).argmax(1) == y_test[i : i + 500]).sum())
            for i in range(0, TEST, 500)
        )
    return {
        "spec": spec,
        "seed": seed,
        "test_accuracy_pct": 100.0 * correct / TEST,
        "train_loss_last20": sum(losses[-20:]) / 20,
        # the mean training loss of every 100-step window: how the gap to dense moves
        "train_loss_per_100": [
            sum(losses[i : i + 100]) / len(losses[i : i + 100]) for i in range(0, STEPS, 100)
        ],
        "cpu_s": cpu_s,
    }


def one_shot_errors(rank: int, world_size: int) -> dict:
    """The candidates' one-shot errors as auto measures them, after 5 dense steps."""
    torch.set_num_threads(1)
    from superneurons.strategy import DEFAULT_CANDIDATES, measure_codecs

    x, y, _, _ = _data()
    model = _model()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    for step in range(6):
        idx = torch.arange(step * BATCH, (step + 1) * BATCH) + rank * 10_000
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x[idx].float()), y[idx]).backward()
        if step < 5:
            opt.step()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    largest = max(grads, key=lambda g: g.numel())
    sample = largest.reshape(largest.shape[0], -1)
    costs = measure_codecs(DEFAULT_CANDIDATES, sample, repeats=1)
    dist.barrier()
    return {"largest_gradient_shape": list(largest.shape)} | {
        c.spec: round(c.rel_error, 4) for c in costs
    }


if __name__ == "__main__":
    import platform

    out = {
        "environment": {
            "command": "python benchmarks/auto_error_budget.py " + " ".join(sys.argv[1:]),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
            "versions": {"python": platform.python_version(), "torch": torch.__version__},
            "torch_threads": 1,
            "shared_machine": f"yes: 1-minute load average {os.getloadavg()[0]:.1f} at start",
        },
        "config": {"steps": STEPS, "batch_per_rank": BATCH, "lr": LR, "model": MODEL},
    }
    if os.environ.get("ONE_SHOT", "1") != "0":
        out["one_shot_rel_error"] = run_ranks(one_shot_errors, world_size=2, timeout_s=600)[0]
        print(out["one_shot_rel_error"], flush=True)
    out["runs"] = []
    for seed in [int(s) for s in os.environ.get("SEEDS", "0").split(",")]:
        for spec in sys.argv[2:]:
            result = run_ranks(one, spec, seed, world_size=2, timeout_s=1800)[0]
            result["load_avg_1m"] = os.getloadavg()[0]
            print(result, flush=True)
            out["runs"].append(result)
            with open(sys.argv[1], "w", encoding="utf-8") as handle:  # after each run
                json.dump(out, handle, indent=1)
