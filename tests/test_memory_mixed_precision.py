"""Mixed precision predicted exactly: autocast's cached parameter casts, an enclosing autocast
around the planning call, and fp32 master weights an optimizer keeps for bf16 parameters.

CPU, bf16, the c10 allocator's view (:func:`~superneurons.bench.memory.meter.allocator_peak_bytes`)
against the prediction, gradients bitwise equal to eager.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from superneurons.bench.memory.meter import allocator_peak_bytes
from superneurons.memory import apply_plan, make_plan
from superneurons.memory.planner.decide import strategy_floors
from superneurons.memory.profiling.step import profile_step

WIDTH, TOKENS, BLOCKS, REPEAT = 256, 16, 4, 64


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(BLOCKS)]
    )


X = torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(1))
Y = torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(2))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # a metric beside the loss: a large temporary at the forward's end that backward never
    # holds, so the step's peak is where autocast's cache still holds every weight's bf16 cast
    with torch.no_grad():
        out.float().repeat(1, REPEAT).softmax(-1).amax()
    return F.mse_loss(out.float(), target)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _loss(model(X), Y)
    loss.backward()  # backward and the step outside autocast (PyTorch's AMP recipe)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _resident(
    model: nn.Module, opt: torch.optim.Optimizer, *inputs: torch.Tensor
) -> list[torch.Tensor]:
    """What is alive at a step's start: parameters, buffers, optimizer state, the inputs."""
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return [*model.parameters(), *model.buffers(), *state, *inputs]


def test_autocast_cached_casts_live_to_the_forward_end_under_recompute() -> None:
    model = _blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt)
    profile = profile_step(model, X, Y, _loss, opt, autocast=torch.bfloat16)
    cached = sum(life.nbytes for life in profile.storages if life.cached)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    # each weight's bf16 cast its matmul saves: all but the first (its input needs no grad)
    assert cached == sum(m.weight.numel() * 2 for m in linears[1:])
    floor = strategy_floors(profile)["recompute"].min_budget_bytes
    plan = make_plan(profile, budget_bytes=floor, strategy="recompute")
    assert plan.count("recompute") == BLOCKS
    twin = _blocks()
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    for _ in range(4):
        _step(twin, twin_opt)
    with apply_plan(model, plan):
        _step(model, opt)
        peak = allocator_peak_bytes(
            lambda: _step(model, opt), resident=lambda: _resident(model, opt, X, Y)
        )
    assert peak <= plan.budget_bytes
    assert abs(peak - plan.predicted_peak_bytes) <= 0.01 * peak
    for a, b in zip(twin.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


transformers = pytest.importorskip("transformers")
VOCAB, SEQ, BATCH = 512, 128, 4
IDS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _llama(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=172, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(dtype).train()


def _llama_step(model: nn.Module, opt: torch.optim.Optimizer, autocast: bool = False) -> None:
    batch = {"input_ids": IDS, "labels": IDS}
    guard = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with guard:
        loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_an_enclosing_autocast_is_the_forward_only_autocast() -> None:
    from superneurons.integrations.hf import plan_for_batch

    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _llama_step(model, opt, autocast=True)
    batch = {"input_ids": IDS, "labels": IDS}
    forward_only = plan_for_batch(
        model, batch, budget_fraction=1.0, optimizer=opt, autocast=torch.bfloat16
    )
    # the whole planning call under the user's autocast: backward and the step still run
    # outside it, as in the loop (under it, the profile over-predicted the floor by 7.4%)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        enclosed = plan_for_batch(model, batch, budget_fraction=1.0, optimizer=opt)
    fp32 = plan_for_batch(model, batch, budget_fraction=1.0, optimizer=opt)
    floor = forward_only.min_budget_bytes
    assert abs(enclosed.min_budget_bytes - floor) <= 0.01 * floor
    assert abs(enclosed.predicted_peak_bytes - forward_only.predicted_peak_bytes) <= 0.01 * floor
    assert fp32.min_budget_bytes > 1.05 * floor  # autocast was seen: bf16 activations


class _MasterAdamW(torch.optim.AdamW):
    """AdamW over fp32 master copies of bf16 parameters, kept in its own state (``master``):
    each step updates the master with the gradient in fp32 and writes it back rounded."""

    def step(self, closure: Any = None) -> Any:
        swapped = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                # the first step makes it (after AdamW made its moments of an empty state)
                master = self.state[p].get("master", None)
                master = p.detach().float() if master is None else master
                swapped.append((p, p.data, p.grad, master))
                p.data, p.grad = master, p.grad.float()
        try:
            return super().step(closure)
        finally:
            for p, low, grad, master in swapped:
                self.state[p]["master"] = master
                low.copy_(master)
                p.data, p.grad = low, grad


def test_fp32_master_weights_in_the_optimizer_state_are_predicted_exactly() -> None:
    model = _llama(torch.bfloat16)
    opt = _MasterAdamW(model.parameters(), lr=1e-3)
    _llama_step(model, opt)
    batch = {"input_ids": IDS, "labels": IDS}
    profile = profile_step(model, batch, None, _hf_loss, opt, keep_output=False)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    # fp32 master + fp32 moments per element, a 4-byte step count per parameter
    assert profile.optimizer_state_bytes == 12 * numel + 4 * len(params)
    eager = profile.predicted_peak_bytes()
    floors = strategy_floors(profile)
    floor = floors["recompute"].min_budget_bytes  # the state weighs: 60% is below it
    budgets = ((eager + floor) // 2, floor)
    twin = _llama(torch.bfloat16)
    twin_opt = _MasterAdamW(twin.parameters(), lr=1e-3)
    for _ in range(1 + 3 * len(budgets)):  # the warm-up; per budget one and the meter's two
        _llama_step(twin, twin_opt)
    for budget in budgets:
        plan = make_plan(profile, budget_bytes=budget, strategy="recompute")
        with apply_plan(model, plan):
            _llama_step(model, opt)
            peak = allocator_peak_bytes(
                lambda: _llama_step(model, opt), resident=lambda: _resident(model, opt, IDS)
            )
        assert peak <= budget
        assert abs(peak - plan.predicted_peak_bytes) <= 0.01 * peak
    for a, b in zip(twin.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def _hf_loss(output: Any, _targets: Any) -> torch.Tensor:
    return output.loss
