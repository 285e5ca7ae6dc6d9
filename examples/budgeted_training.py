"""Train a ResNet on Fashion-MNIST under a device-memory budget (SuperNeurons, PPoPP'18).

    python examples/budgeted_training.py --budget-fraction 0.8 --steps 20

1. profile one training step (liveness of every saved activation),
2. plan keep / offload / recompute per residual block so the predicted peak fits the budget,
3. train in an ordinary eager loop inside ``with apply_plan(model, plan):``.

Gradients are those of eager PyTorch (bitwise on CPU fp32); BatchNorm statistics are updated
once per step even in recomputed blocks. The budget here is a fraction of eager's predicted peak;
pass an absolute one with ``--budget 300MiB``.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from superneurons import format_bytes, parse_bytes
from superneurons.data import fashion_mnist
from superneurons.memory import InfeasibleBudgetError, apply_plan, make_plan, profile_step
from superneurons.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default=None, help="device budget, e.g. 300MiB")
    parser.add_argument("--budget-fraction", type=float, default=0.8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(0)

    # The first GPU when there is one (activations offload to pinned host memory), else the CPU.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pinned = device.type == "cuda"  # batches copy from pinned memory, overlapping host work
    model = build_model(
        "resnet",
        layers=(2, 2, 2, 2),
        block="basic",
        width=32,
        num_classes=10,
        in_channels=1,
        small_input=True,
    )
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(
        fashion_mnist(split="train"),
        batch_size=args.batch,
        shuffle=True,
        pin_memory=pinned,
    )
    images, labels = (t.to(device, non_blocking=pinned) for t in next(iter(loader)))

    profile = profile_step(model, images, labels, F.cross_entropy, optimizer)
    eager_peak = profile.predicted_peak_bytes()
    budget = parse_bytes(args.budget) if args.budget else int(eager_peak * args.budget_fraction)
    try:
        plan = make_plan(profile, budget_bytes=budget)
    except InfeasibleBudgetError as exc:  # below what any strategy reaches: use that minimum
        print(
            f"budget {format_bytes(budget)} is infeasible; using the minimum "
            f"{format_bytes(exc.min_budget_bytes)} ({exc.strategy})"
        )
        budget = exc.min_budget_bytes
        plan = make_plan(profile, budget_bytes=budget)
    print(
        f"eager peak {format_bytes(eager_peak)}, budget {format_bytes(budget)}, "
        f"plan peak {format_bytes(plan.predicted_peak_bytes)}: "
        f"{plan.count('keep')} keep, {plan.count('offload')} offload, "
        f"{plan.count('recompute')} recompute"
    )

    def sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    factory = sgd if plan.optimizer_in_backward else None
    with apply_plan(model, plan, optimizer_factory=factory) as handle:
        for step, batch in zip(range(args.steps), loader, strict=False):
            images, labels = (t.to(device, non_blocking=pinned) for t in batch)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            if not plan.optimizer_in_backward:
                optimizer.step()
            if step % 5 == 0:
                print(f"step {step:3d}  loss {loss.item():.4f}")
        print("pool:", handle.stats()["pool"])


if __name__ == "__main__":
    main()
