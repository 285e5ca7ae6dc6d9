"""Where a plan's peak is and what it holds: ``Plan.peak_at`` / ``Plan.breakdown`` and the
per-strategy floors of ``strategy_floors`` (``plan --json`` ``strategies``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from superneurons.memory.plan import SEARCH_STRATEGIES, STRATEGIES
from superneurons.memory.planner.decide import make_plan, min_peak_bytes, strategy_floors
from superneurons.memory.planner.predict import BREAKDOWN
from superneurons.memory.profile_types import Profile
from superneurons.memory.profiling.step import profile_step

VOCAB, WIDTH, BATCH, SEQ = 512, 32, 4, 16


class _TinyLM(nn.Module):
    """Embedding, three MLP blocks, an LM head: the shape of a causal LM's step."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.h = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
            for _ in range(3)
        )
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)  # (B, T, C)
        for block in self.h:
            x = x + block(x)
        return self.lm_head(x)  # (B, T, V)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


@pytest.fixture(scope="module")
def profile() -> Profile:
    model = _TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ))
    return profile_step(model, idx, idx, _loss, opt, fake=True)


def test_the_output_embedding_is_the_head_unit(profile: Profile) -> None:
    assert profile.head_unit == "lm_head"
    logits_bytes = BATCH * SEQ * VOCAB * 4
    # right after the loss's forward the logits (the caller keeps them) are head + loss bytes
    assert profile.head_rows()[:, profile.forward_end_event].sum() >= logits_bytes


@pytest.mark.parametrize("strategy", SEARCH_STRATEGIES)
def test_breakdown_sums_to_each_strategy_floor(profile: Profile, strategy: str) -> None:
    floor = strategy_floors(profile)[strategy]
    assert floor.min_budget_bytes == min_peak_bytes(profile)[strategy]
    assert set(floor.breakdown) == set(BREAKDOWN)
    assert sum(floor.breakdown.values()) == floor.min_budget_bytes
    assert all(v >= 0 for v in floor.breakdown.values()), floor.breakdown
    assert floor.peak_at["phase"] in ("forward", "loss", "backward", "step")
    assert floor.eager_peak_bytes == profile.predicted_peak_bytes()
    record = floor.to_dict()
    assert record["floor_over_largest_layer"] == pytest.approx(
        floor.min_budget_bytes / (floor.resident_bytes + floor.largest_unit_bytes)
    )


def test_the_eager_peak_of_a_language_model_is_its_head_and_loss(profile: Profile) -> None:
    plan = make_plan(profile, budget_bytes=10 * profile.predicted_peak_bytes(), strategy="eager")
    assert sum(plan.breakdown.values()) == plan.predicted_peak_bytes
    # the vocabulary is 4x the hidden width x 4: the logits, their softmax and gradient bind
    assert plan.peak_at["unit"] in ("<loss>", "lm_head")
    assert plan.breakdown["head_loss"] == max(plan.breakdown.values())


def test_the_strategy_list_is_one_list() -> None:
    assert tuple(s for s in STRATEGIES if s != "auto") == SEARCH_STRATEGIES
