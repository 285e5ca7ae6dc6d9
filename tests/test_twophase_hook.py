"""The two-phase all-reduce as a DDP route (2 gloo ranks, tiny buckets: one per parameter):
lossless at 32 bits equals plain DDP bit for bit, quantised runs keep the ranks identical,
a resume continues bit for bit, and a non-finite gradient is non-finite everywhere."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed import Ranks, shared_ranks

pytestmark = pytest.mark.dist

_TINY_BUCKET_MB = 0.0001
_RESUME_SPEC = "twophase:bits=2,chunk=8,rounding=stochastic,transform=hadamard"


@pytest.fixture(scope="module")
def ranks() -> Ranks:
    return shared_ranks(2)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 6, 3)
        self.fc1 = nn.Linear(6 * 4 * 4, 33)  # odd sizes: padded slices
        self.out = nn.Linear(33, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1))))


def _ddp() -> DistributedDataParallel:
    torch.manual_seed(0)
    return DistributedDataParallel(_Net(), bucket_cap_mb=_TINY_BUCKET_MB)


def _step(model: Any, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(8, 2, 6, 6, generator=gen), torch.randint(0, 5, (8,), generator=gen)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()


def _train(model: Any, state: Any, steps: int, rank: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        _step(model, opt, rank, state.step if state is not None else 0)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _cases(rank: int, world_size: int) -> dict[str, Any]:
    from superneurons.ddp.hook import register_compression

    out: dict[str, Any] = {}
    # lossless: reduce-scatter + all-gather of fp32 equals DDP's all-reduce (2 ranks: exact)
    plain = _ddp()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(3):
        _step(plain, opt, rank, step)
        opt.step()
    hooked = _ddp()
    state = register_compression(hooked, "twophase:bits=32,chunk=8")
    out["lossless"] = (
        [p.detach().clone() for p in plain.parameters()],
        _train(hooked, state, 3, rank),
    )
    # quantised settings: training moves, the ranks agree, bytes sent below dense
    for spec in ("twophase:bits=1", "twophase:bits=4,chunk=64,transform=dct", "twophase:bits=8"):
        model = _ddp()
        state = register_compression(model, spec)
        params = _train(model, state, 3, rank)
        out[spec] = (
            params,
            state.bytes_sent_step,
            state.dense_bytes_step,
            sorted(state.twophase.worker),
        )  # type: ignore[union-attr]
    # resume: save after 3 steps, load into fresh objects, 3 more == 6 straight
    runs = []
    for resume in (False, True):
        model = _ddp()
        state = register_compression(model, _RESUME_SPEC, seed=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(6):
            if resume and step == 3:
                saved = {
                    "model": model.module.state_dict(),
                    "opt": opt.state_dict(),
                    "sync": state.state_dict(),
                }
                model = _ddp()
                state = register_compression(model, _RESUME_SPEC, seed=3)
                opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                model.module.load_state_dict(saved["model"])
                opt.load_state_dict(saved["opt"])
                state.load_state_dict(saved["sync"])
            _step(model, opt, rank, state.step)
            opt.step()
        assert state.twophase is not None
        residuals = [state.twophase.worker[k] for k in sorted(state.twophase.worker)]
        residuals += [state.twophase.owner[k] for k in sorted(state.twophase.owner)]
        runs.append(([p.detach().clone() for p in model.parameters()], residuals))
    out["resume"] = runs
    # a NaN on one rank: non-finite on every rank, residuals stay finite
    model = _ddp()
    state = register_compression(model, "twophase:bits=4,chunk=8")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    poison = {"on": False}

    def add_nan(grad: torch.Tensor) -> torch.Tensor:
        if poison["on"] and rank == 1:
            grad = grad.clone()
            grad.view(-1)[0] = float("nan")
        return grad

    model.module.fc1.weight.register_hook(add_nan)
    finite = []
    for step in range(3):
        poison["on"] = step == 1
        _step(model, opt, rank, step)
        finite.append(bool(torch.isfinite(model.module.fc1.weight.grad).all()))  # type: ignore[arg-type]
        if finite[-1]:
            opt.step()
    assert state.twophase is not None
    residuals = list(state.twophase.worker.values()) + list(state.twophase.owner.values())
    out["nan"] = (finite, all(bool(torch.isfinite(r).all()) for r in residuals))
    # auto moves every parameter off the two-phase route: what the residuals owe is sent
    from superneurons.codecs.twophase import TwoPhase
    from superneurons.strategy import Assignment

    model = _ddp()
    state = register_compression(model, "auto:observe_steps=1,drift=1000.0,drift_steps=50")
    assert state.auto is not None
    names = [name for name, _ in model.module.named_parameters()]
    two = TwoPhase(bits=4, chunk=8)
    state.auto.apply(Assignment(1, {"all": two}, dict.fromkeys(names, two), 0.1, "test"), step=0)
    _train(model, state, 2, rank)
    held = (len(state.twophase.worker), len(state.twophase.owner))  # type: ignore[union-attr]
    state.auto.apply(Assignment(1, {"all": None}, dict.fromkeys(names), 0.1, "test"), step=2)
    params = _train(model, state, 1, rank)
    out["switch"] = (held, state.twophase.configs, state.residuals, params)  # type: ignore[union-attr]
    return out


def test_twophase_route_through_ddp(ranks: Ranks) -> None:
    results = ranks.run(_cases, timeout_s=180)
    torch.manual_seed(0)
    initial = [p.detach() for p in _Net().parameters()]
    for got in results:
        plain, hooked = got["lossless"]
        for a, b in zip(plain, hooked, strict=True):
            assert torch.equal(a, b)
        straight, resumed = got["resume"]
        assert len(straight[1]) == 2 * 6  # worker and owner residuals of every parameter
        for a, b in zip(straight[0] + straight[1], resumed[0] + resumed[1], strict=True):
            assert torch.equal(a, b)
        assert got["nan"] == ([True, False, True], True)
        held, configs, residuals, _ = got["switch"]
        assert held == (6, 6) and not configs and not residuals  # all sent by the dense step
    for a, b in zip(results[0]["switch"][3], results[1]["switch"][3], strict=True):
        assert torch.equal(a, b)
    for spec in ("twophase:bits=1", "twophase:bits=4,chunk=64,transform=dct", "twophase:bits=8"):
        params0, sent, dense, names = results[0][spec]
        assert len(names) == 6 and 0 < sent < dense, spec
        assert any(not torch.equal(a, b) for a, b in zip(params0, initial, strict=True)), spec
        for rank in range(1, len(results)):
            for a, b in zip(params0, results[rank][spec][0], strict=True):
                assert torch.equal(a, b), spec
