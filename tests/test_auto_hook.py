"""``auto`` through the hook on 2 gloo ranks: one decision everywhere, re-decisions in lock step,
mixed per-parameter routes, and save -> resume restoring the decision and continuing bitwise."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed import Ranks, shared_ranks

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def ranks() -> Ranks:
    return shared_ranks(2)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 6, 3)
        self.fc1 = nn.Linear(6 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 32)
        self.out = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).flatten(1)
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(h)))))


def _ddp() -> DistributedDataParallel:
    torch.manual_seed(0)
    return DistributedDataParallel(_Net(), bucket_cap_mb=0.005)  # a few buckets


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, start: int, n: int) -> None:
    for step in range(start, start + n):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(8, 2, 6, 6, generator=gen), torch.randint(0, 5, (8,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _mixed() -> Any:
    """A hand-made decision: every kind of route in one model."""
    from superneurons.compress import parse_spec
    from superneurons.strategy import Assignment

    params = {
        "module.conv.weight": "fp16",
        "module.conv.bias": "dense",
        "module.fc1.weight": "topk:ratio=0.1",
        "module.fc1.bias": "qsgd",
        "module.fc2.weight": "powersgd:rank=2",
        "module.fc2.bias": "bf16",
        "module.out.weight": "topk:ratio=0.5",
        "module.out.bias": "twophase:bits=2,chunk=8,rounding=stochastic,transform=hadamard",
    }
    routes = {
        k.removeprefix("module."): None if v == "dense" else parse_spec(v)
        for k, v in params.items()
    }
    return Assignment(1, {"all": None}, routes, 0.1, "hand-made for the test")


def _decide_and_redecide(rank: int, world_size: int) -> dict[str, Any]:
    from superneurons.compress import register_compression

    out: dict[str, Any] = {}
    model = _ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = register_compression(model, "auto:observe_steps=2,drift=1000.0,drift_steps=3")
    assert state.auto is not None
    _train(model, opt, rank, 0, 5)
    assert state.auto.assignment is not None
    out["decision"] = state.auto.assignment.to_json()
    out["outside_s"] = state.auto.assignment.outside_s
    out["params"] = _params(model)
    out["summary"] = state.summary()
    # drift=1e-9: every step "drifts", so the ranks re-decide every 2 steps, together
    model = _ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = register_compression(model, "auto:observe_steps=1,drift=1e-09,drift_steps=2")
    assert state.auto is not None
    _train(model, opt, rank, 0, 12)
    out["decisions"] = state.auto.decisions
    out["params_redecided"] = _params(model)
    return out


def test_every_rank_applies_the_same_decision_and_redecides_in_lock_step(ranks: Ranks) -> None:
    rank0, rank1 = ranks.run(_decide_and_redecide, timeout_s=180)
    assert rank0["decision"] == rank1["decision"]
    # forward and the optimizer step take time: measured outside backward, > 0 on every rank
    assert rank0["outside_s"] == rank1["outside_s"] > 0.0
    assert rank0["summary"]["sync_assignment"] == rank1["summary"]["sync_assignment"] is not None
    assert rank0["summary"]["compression"].startswith("ef(auto:")
    for a, b in zip(rank0["params"], rank1["params"], strict=True):
        assert torch.equal(a, b)
    assert rank0["decisions"] == rank1["decisions"] >= 2
    for a, b in zip(rank0["params_redecided"], rank1["params_redecided"], strict=True):
        assert torch.equal(a, b)


def _mixed_and_resume(rank: int, world_size: int) -> dict[str, Any]:
    from superneurons.compress import register_compression

    spec = "auto:observe_steps=1,drift=1000.0,drift_steps=50"
    model = _ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = register_compression(model, spec)
    assert state.auto is not None
    state.auto.apply(_mixed(), step=0)
    _train(model, opt, rank, 0, 3)
    sent, dense = state.bytes_sent_step, state.dense_bytes_step
    saved = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": copy.deepcopy(opt.state_dict()),  # momentum buffers change in place
        "compression": state.state_dict(),
    }
    _train(model, opt, rank, 3, 3)
    straight = _params(model)
    resumed_model = _ddp()
    resumed_opt = torch.optim.SGD(resumed_model.parameters(), lr=0.05, momentum=0.9)
    resumed = register_compression(resumed_model, spec)
    resumed_model.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    resumed.load_state_dict(saved["compression"])
    assert resumed.auto is not None and resumed.auto.assignment == state.auto.assignment
    _train(resumed_model, resumed_opt, rank, 3, 3)
    return {"sent": sent, "dense": dense, "straight": straight, "resumed": _params(resumed_model)}


def test_mixed_routes_keep_ranks_identical_and_resume_continues_bitwise(ranks: Ranks) -> None:
    rank0, rank1 = ranks.run(_mixed_and_resume, timeout_s=180)
    assert 0 < rank0["sent"] < rank0["dense"]
    for a, b, c in zip(rank0["straight"], rank1["straight"], rank0["resumed"], strict=True):
        assert torch.equal(a, b)
        assert torch.equal(a, c)
    for a, b in zip(rank1["straight"], rank1["resumed"], strict=True):
        assert torch.equal(a, b)
