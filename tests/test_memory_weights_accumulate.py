"""Streamed weights with the trainer's step: gradients accumulated over micro-batches and clipped
by their global norm equal eager's ``loss / k`` backward passes, ``clip_grad_norm_`` and the
step, bit for bit (the host optimizer holds the steps until the last micro-batch)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from superneurons.memory import apply_plan
from superneurons.memory.plan import TrainingStep
from test_memory_weights import _adamw, _batch, _net, _plan

STEPS = 3


def _eager(step: TrainingStep) -> tuple[torch.nn.Module, list[float]]:
    model = _net()
    opt = _adamw(model.parameters())
    k, norms = step.accumulation_steps, []
    for s in range(STEPS):
        opt.zero_grad()
        for m in range(k):
            ids, targets = _batch(s * k + m)
            (F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()) / k).backward()
        if step.clips:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), step.max_grad_norm)
            norms.append(float(norm))
        opt.step()
    return model, norms


def _streamed(step: TrainingStep) -> tuple[torch.nn.Module, list[float]]:
    model = _net()
    plan = dataclasses.replace(
        _plan(("embed", "blocks.0", "blocks.1", "head"), {"blocks.1": "recompute"}), step=step
    )
    k, norms, micro = step.accumulation_steps, [], [0]
    with apply_plan(model, plan, optimizer_factory=_adamw) as handle:
        opt, buckets = handle.optimizer, handle.buckets
        assert opt is not None and buckets is not None and handle.weights is not None
        buckets.sync = lambda: micro[0] == k - 1  # the last backward of the micro-batches
        for s in range(STEPS):
            opt.zero_grad()
            for m in range(k):
                micro[0] = m
                ids, targets = _batch(s * k + m)
                (F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()) / k).backward()
                assert handle.weights.stats().device_bytes == 0  # no copy kept across them
            if step.clips:
                norms.append(float(opt.clip_grad_norm_(step.max_grad_norm, 2.0)))
            opt.step()
    return model, norms


@pytest.mark.parametrize(("k", "max_norm"), [(2, 0.0), (3, 0.5)])
def test_streamed_weights_accumulate_and_clip_as_eager(k: int, max_norm: float) -> None:
    step = TrainingStep(accumulation_steps=k, max_grad_norm=max_norm)
    eager, eager_norms = _eager(step)
    ours, our_norms = _streamed(step)
    assert our_norms == eager_norms
    if max_norm:
        assert max(eager_norms) > max_norm  # clipping acts
    for (fqn, a), b in zip(eager.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(a, b), fqn
