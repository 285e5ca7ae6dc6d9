"""The demo's memory comparison measures the step the plan was made for, in the view the plan
predicts: eager's measured peak equals the profile's prediction (the output held through
backward, as the trainer holds it) and the planned step's measured peak equals the plan's."""

from __future__ import annotations

import pytest
import torch

from superneurons.demo.memory import compare_memory
from superneurons.memory.profiling.step import profile_step
from superneurons.models.zoo import build_model, default_loss, model_input
from superneurons.train.task import TASKS

TINY_LM = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 32, "vocab_size": 4096}


def test_eager_peak_matches_the_profile_and_plan_fits() -> None:
    torch.manual_seed(0)
    model = build_model("gpt", **TINY_LM)
    x, y = model_input("gpt", 4, **TINY_LM)
    loss_fn = default_loss("gpt")

    def make_optimizer(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-3)

    profile = profile_step(model, x, y, loss_fn, make_optimizer(model))
    minimum: list[float] = []  # the LM head bounds the floor: the demo then runs at it
    result = compare_memory(
        model, make_optimizer, x, y, loss_fn, budget_fraction=0.8, on_minimum=minimum.append
    )
    # logits (4 x 32 x 4096 fp32 = 2 MiB) dominate: dropping them before backward showed here
    # as a peak 22% below the profile; what remains is a few small scalars (< 0.1%)
    assert result.eager_peak_bytes == pytest.approx(profile.predicted_peak_bytes(), rel=1e-3)
    assert result.planned_peak_bytes <= result.budget_bytes


def test_demo_resnet_plan_predicts_the_measured_peak() -> None:
    """The demo's own model and optimizer at its floor plan: the peak is a convolution
    backward's scratch (im2col) inside a recomputed unit. A real CPU profile counts that
    scratch, so the measurement must too: measured by live storages alone it read 17% below
    the prediction (29.6 vs 35.8 MiB at the demo's batch of 64)."""
    torch.manual_seed(0)
    model = build_model("resnet", **TASKS[("resnet", "fashion-mnist")])
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))

    def make_optimizer(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    loss_fn = default_loss("resnet")
    profile = profile_step(model, x, y, loss_fn, make_optimizer(model))
    result = compare_memory(
        model, make_optimizer, x, y, loss_fn, budget_fraction=0.5, on_minimum=lambda _f: None
    )
    assert result.measured_by == "c10 cpu allocator"
    assert result.plan.count("recompute") + result.plan.count("recompute+offload") > 0
    assert result.eager_peak_bytes == pytest.approx(profile.predicted_peak_bytes(), rel=0.01)
    assert result.planned_peak_bytes == pytest.approx(result.plan.predicted_peak_bytes, rel=0.01)
    assert result.planned_peak_bytes <= result.budget_bytes
    # the case holds what a live-storage count misses: scratch is part of the planned peak
    assert result.planned_tracked_peak_bytes < 0.97 * result.planned_peak_bytes
    assert max(result.planned_timeline_bytes) == result.planned_peak_bytes
