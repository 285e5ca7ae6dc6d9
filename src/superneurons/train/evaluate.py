"""How well the model does: accuracy on one batch, and loss and accuracy on the test split."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset

from superneurons.device import Placement
from superneurons.train.config import TrainConfig
from superneurons.train.task import Task

__all__ = ["batch_accuracy", "evaluate"]


def batch_accuracy(output: torch.Tensor, targets: torch.Tensor) -> float:
    """The fraction of ``targets`` the arg-max of ``output`` (``(B, classes)``) gets right."""
    return float((output.argmax(dim=-1) == targets).float().mean())


@torch.no_grad()
def evaluate(
    model: nn.Module, task: Task, config: TrainConfig, device: Placement | torch.device
) -> dict[str, float]:
    """Loss and accuracy on the test split (its first ``config.eval_limit`` samples where
    set), each rank a shard, summed by all-reduce."""
    placement = Placement.of(device)
    model.eval()
    test_set = task.test_set
    if config.eval_limit is not None and config.eval_limit < len(test_set):  # type: ignore[arg-type]
        test_set = Subset(test_set, range(config.eval_limit))
    sampler: DistributedSampler[Any] = DistributedSampler(test_set, shuffle=False)
    loader = DataLoader(
        test_set,
        batch_size=config.batch_size,
        sampler=sampler,
        pin_memory=placement.pin_memory,
    )
    # loss sum, correct, count (fp64 on the device: NCCL all-reduces device tensors)
    totals = torch.zeros(3, dtype=torch.float64, device=placement.device)
    for index, (inputs, targets) in enumerate(loader):
        if config.limit_steps is not None and index >= config.limit_steps:
            break
        inputs, targets = placement.batch((inputs, targets))
        output = model(inputs)
        count = targets.numel()
        totals[0] += float(task.loss_fn(output, targets)) * count
        totals[1] += float((output.argmax(dim=-1) == targets).sum())
        totals[2] += count
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / max(count, 1), "test_accuracy": correct / max(count, 1)}
