"""Profiling is side-effect free: the user's model (patched forwards, wrappers, frozen and tied
parameters, BatchNorm), optimizer (wrapped, scheduled, with state) and RNG are exactly as they
were, and the step profiled is the one the trainer runs (its forward, its optimizer's state)."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
import torch
from torch import nn

from integrations_support import TinyLM, batch
from sentinel import assert_same, fingerprint
from superneurons.errors import ConfigError
from superneurons.integrations.hf import plan_for_batch
from superneurons.memory import profile_step
from superneurons.memory.offload.handover import inner_optimizer
from superneurons.memory.profile_types import ALLOCATOR_MARGIN_BYTES
from superneurons.memory.profiling.isolate import IsolationError, isolated


class _Wrapped(torch.optim.Optimizer):
    """Like accelerate's ``AcceleratedOptimizer``: an ``Optimizer`` subclass around the real one
    whose ``param_groups`` and ``state`` are the inner optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # noqa: D107 - no super().__init__
        self.optimizer = optimizer

    @property
    def param_groups(self) -> Any:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        raise AssertionError("the wrapper must never step in a profile")


class _Net(nn.Module):
    """Tied embedding/head, a frozen parameter, BatchNorm, dropout, ModuleList blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.2)) for _ in "ab"]
        )
        self.scale = nn.Parameter(torch.ones(16), requires_grad=False)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids).flatten(0, 1)  # (B*T, C)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(h * self.scale)
        return {"loss": nn.functional.cross_entropy(logits, labels.flatten())}


def _args(data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return data["input_ids"], data["labels"]


def _patch_forward_like_trl(model: nn.Module) -> None:
    """TRL's ``add_fused_lm_head``: an instance-level forward closing over the original bound
    method (a deep copy of the model would call back into *this* model)."""
    original_forward = model.forward

    def forward(self: nn.Module, *args: Any, fused: bool = False, **kwargs: Any) -> Any:
        out = original_forward(*args, **kwargs)
        return {"loss": out["loss"] * 2} if fused else out

    model.forward = types.MethodType(forward, model)  # type: ignore[method-assign]


def _trained_setup(kind: type[torch.optim.Optimizer] = torch.optim.AdamW) -> Any:
    torch.manual_seed(0)
    model = _Net()
    _patch_forward_like_trl(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = kind(trainable, lr=1e-2, **({"momentum": 0.9} if kind is torch.optim.SGD else {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    model(**batch(0))["loss"].backward()
    optimizer.step()
    scheduler.step()  # state exists; the scheduler patched optimizer.step on the instance
    model.zero_grad(set_to_none=False)  # gradients exist (zeros), as between steps
    return model, _Wrapped(optimizer), scheduler


def test_profile_and_plan_leave_the_training_state_exactly_as_it_was() -> None:
    model, optimizer, scheduler = _trained_setup()
    model.eval()  # a mode that is not training: planning profiles in train mode, restores eval
    before = fingerprint(model, optimizer, scheduler)
    data = batch(1, size=16, seq=64)  # activations worth more than a recompute's rng state
    profile = profile_step(model, _args(data), None, lambda out, _: out["loss"], optimizer)
    assert_same(before, fingerprint(model, optimizer, scheduler))
    eager = plan_for_batch(model, data, budget_fraction=1.0, optimizer=optimizer)
    assert_same(before, fingerprint(model, optimizer, scheduler))
    budget = eager.predicted_peak_bytes - 1  # a plan that must act
    plan = plan_for_batch(model, data, budget_bytes=budget, optimizer=optimizer)
    assert_same(before, fingerprint(model, optimizer, scheduler))
    assert plan.count("recompute") + plan.count("offload") > 0
    # the patched forward ran on the model itself: its blocks were observed
    assert {u.fqn for u in profile.units} >= {"blocks.0", "blocks.1"}
    # the optimizer's real state (two moments per trainable parameter) was counted
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert profile.optimizer_state_bytes >= 2 * trainable


def test_fake_profile_leaves_the_real_model_untouched_and_equals_the_real_one() -> None:
    # NOTE: SGD: Adam's step counter, copied to a fake tensor, cannot be read under fake
    # tensors (``.item()``), with or without isolation; a fresh Adam state is fine.
    model, optimizer, scheduler = _trained_setup(torch.optim.SGD)
    before = fingerprint(model, optimizer, scheduler)
    fake = profile_step(model, _args(batch(1)), None, lambda o, _: o["loss"], optimizer, fake=True)
    real = profile_step(model, _args(batch(1)), None, lambda o, _: o["loss"], optimizer)
    assert_same(before, fingerprint(model, optimizer, scheduler))
    # the same live tensors; a real cpu profile adds what only the allocator sees (kernel
    # scratch, the generator states checkpoints stash, the stated margin)
    assert (fake.scratch, fake.rng_state_bytes, fake.margin_bytes) == ((), 0, 0)
    assert real.margin_bytes == ALLOCATOR_MARGIN_BYTES
    tensors_only = dataclasses.replace(real, scratch=(), rng_state_bytes=0, margin_bytes=0)
    assert fake.predicted_peak_bytes() == tensors_only.predicted_peak_bytes()


def test_optimizer_state_is_counted_even_before_the_first_step() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    adamw = torch.optim.AdamW(model.parameters())
    torch.optim.lr_scheduler.LambdaLR(adamw, lambda s: 1.0)  # patches adamw.step
    profile = profile_step(model, _args(batch(0)), None, lambda o, _: o["loss"], _Wrapped(adamw))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert profile.optimizer_state_bytes == 2 * params + 4 * len(list(model.parameters()))
    assert not adamw.state  # the shadow stepped, not adamw


def test_wrappers_are_unwrapped_to_the_optimizer_that_steps() -> None:
    adamw = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    assert inner_optimizer(_Wrapped(adamw)) is adamw
    assert inner_optimizer(adamw) is adamw
    with pytest.raises(ConfigError, match="not a torch optimizer"):
        inner_optimizer(object())


def test_compile_and_ddp_wrappers_are_taken_off() -> None:
    model = TinyLM()
    compiled = torch.compile(model)  # never run: profiling runs its _orig_mod
    before = fingerprint(model)
    with isolated(compiled) as (inner, _):
        assert inner is model
    profile = profile_step(compiled, _args(batch(0)), None, lambda o, _: o["loss"])
    assert_same(before, fingerprint(model))
    assert {u.fqn for u in profile.units} >= {"blocks.0", "blocks.1", "blocks.2"}


class _Sneaky(nn.Module):
    """Keeps its parameters in a plain list too and updates one in place in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.hidden = [self.fc.weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.hidden[0].mul_(1.0)  # in place on the original, outside the module tree
        return self.fc(x) @ self.hidden[0]


def test_a_step_reaching_an_original_outside_the_tree_is_caught() -> None:
    model = _Sneaky()
    with pytest.raises(IsolationError, match="hidden|fc.weight"):
        profile_step(model, torch.randn(2, 4), None, lambda o, _: o.sum())
    assert model.fc.weight.grad is None  # the gradient it received was taken off again


def test_frozen_parameters_are_shared_but_never_stepped() -> None:
    model = _Net()  # ``scale`` is frozen: profiled in place, not copied
    model.scale.grad = torch.ones(16)  # stale: the user's optimizer would step it
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # frozen one included, as often
    before = fingerprint(model, optimizer)
    profile_step(model, _args(batch(0)), None, lambda o, _: o["loss"], optimizer)
    assert_same(before, fingerprint(model, optimizer))
