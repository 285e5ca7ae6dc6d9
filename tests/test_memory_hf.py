"""Hugging Face transformers models under a plan, with their default settings (CPU, fp32).

Tiny GPT-2 (``use_cache=True`` by default, dropout on) and BERT configs: gradients bitwise equal
to eager, the measured peak (the c10 allocator's view) within the budget and within 3% of the
prediction, the key/value cache off in training under a plan (as HF gradient checkpointing
does) and on again afterwards; a unit handed a cache, or writing state in its forward, is
refused with a message naming it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from superneurons.bench.memory.meter import allocator_peak_bytes
from superneurons.errors import ConfigError
from superneurons.memory import PoolConfig, apply_plan, make_plan, profile_step
from superneurons.memory.plan import Plan

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 64, 32, 2


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).train()


def _bert() -> nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=3, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=SEQ,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config).train()


def _lm_loss(output: object, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits  # type: ignore[attr-defined]  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
    )


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    """One training step as train/loop.py runs it (the output lives through backward)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # the same dropout masks in every run
    output = model(x)
    loss = _lm_loss(output, y)
    loss.backward()
    del output, loss
    opt.step()


def _resident(model: nn.Module, opt: torch.optim.Optimizer, *extra: torch.Tensor) -> list:
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return [*model.parameters(), *model.buffers(), *state, *extra]


@pytest.mark.parametrize(
    ("strategy", "build"),
    [
        pytest.param("recompute", _gpt2, id="recompute-gpt2"),
        pytest.param("recompute", _bert, id="recompute-bert"),
        pytest.param("offload", _gpt2, id="offload-gpt2"),
        pytest.param("offload", _bert, id="offload-bert"),
    ],
)
def test_hf_model_under_plan_matches_eager_within_budget(
    build: Callable[[], nn.Module], strategy: str
) -> None:
    torch.manual_seed(0)
    eager = build()
    planned = copy.deepcopy(eager)
    x, y = _batch()
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt_p = torch.optim.SGD(planned.parameters(), lr=0.1, momentum=0.9)
    _step(eager, opt_e, x, y)  # warm-up: momentum buffers exist
    eager_peak = allocator_peak_bytes(  # two steps
        lambda: _step(eager, opt_e, x, y), resident=lambda: _resident(eager, opt_e, x, y)
    )
    _step(planned, opt_p, x, y)
    _step(planned, opt_p, x, y)  # two steps: the same state as eager
    profile = profile_step(planned, x, y, _lm_loss, opt_p)
    # Halfway between the planner's floor for this strategy and eager: a plan that must act.
    floor = make_plan(profile, budget_bytes=eager_peak, strategy=strategy).min_budget_bytes
    budget = (floor + eager_peak) // 2
    plan = make_plan(profile, budget_bytes=budget, strategy=strategy)
    assert plan.count("keep") < len(plan.units), "the plan must act on some unit"
    # the pool keeps saved tensors under PoolConfig.min_offload_bytes (16 KiB) on the device,
    # as the planner predicts: in these tiny models most activations are smaller (8 KiB)
    pool = PoolConfig(host_bytes=plan.host_bytes)
    with apply_plan(planned, plan, pool_config=pool):
        _step(planned, opt_p, x, y)  # warm-up under the plan: the host slab has its size
        # the c10 allocator's view (what a real cpu profile predicts); the pool's slab was
        # allocated in the warm-up, before the meter: not in its view, as on a device
        peak = allocator_peak_bytes(  # two steps
            lambda: _step(planned, opt_p, x, y), resident=lambda: _resident(planned, opt_p, x, y)
        )
    _step(eager, opt_e, x, y)
    _step(eager, opt_e, x, y)  # five steps each, the last three under the plan
    for (name, a), b in zip(eager.named_parameters(), planned.parameters(), strict=True):
        assert torch.equal(a, b), f"{name} differs after a step under the plan"
    assert peak <= budget, f"measured {peak} > budget {budget} ({plan.units})"
    assert abs(peak - plan.predicted_peak_bytes) <= 0.03 * peak


def test_gpt2_cache_off_in_training_under_plan_and_on_again_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = _gpt2()
    x, y = _batch()
    assert model.config.use_cache  # the HF default this test is about
    profile = profile_step(model, x, y, _lm_loss)
    plan = make_plan(profile, budget_bytes=int(1e12), strategy="recompute")
    plan = _all(plan, "recompute")
    with caplog.at_level(logging.WARNING, logger="superneurons.memory"), apply_plan(model, plan):
        out = model(x)
        assert out.past_key_values is None  # no cache written in training
        _lm_loss(out, y).backward()
        with torch.no_grad():  # evaluation / generation keep the cache
            assert model(x).past_key_values.get_seq_length() == SEQ
    assert "use_cache=False" in caplog.text and "GPT2LMHeadModel" in caplog.text
    assert model.config.use_cache  # the user's config is untouched
    assert model(x).past_key_values.get_seq_length() == SEQ  # plan removed: HF default again


def test_unit_handed_a_cache_is_refused_naming_it() -> None:
    model = _gpt2()
    x, y = _batch()
    plan = _all(make_plan(profile_step(model, x, y, _lm_loss), budget_bytes=int(1e12)), "recompute")
    cache = transformers.DynamicCache(config=model.config)
    with apply_plan(model, plan), pytest.raises(ConfigError, match=r"transformer\.h\.0"):
        model(x, past_key_values=cache, use_cache=True)


class _Remembers(nn.Module):
    """A block that keeps its last activation on itself (state written in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = self.fc(x)
        return torch.relu(self.last)


class _Counts(nn.Module):
    """A block that counts its calls in a buffer (an in-place write in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.relu(self.fc(x))


class _Pure(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)  # BN statistics are allowed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.fc(x)))


@pytest.mark.parametrize(
    ("stateful", "attribute"), [(_Remembers, "last"), (_Counts, "calls")], ids=["attr", "buffer"]
)
@pytest.mark.parametrize("action", ["recompute", "offload"])
def test_stateful_forward_is_refused_naming_module(
    stateful: type[nn.Module], attribute: str, action: str
) -> None:
    model = nn.Sequential(nn.Sequential(_Pure(), stateful(), _Pure()))
    plan = _hand_plan(model, {"0.1": action})
    x = torch.randn(4, 8)
    with apply_plan(model, plan), pytest.raises(ConfigError, match=rf"'0\.1'.*'{attribute}'"):
        model(x)
    model(x).sum().backward()  # plan removed: the model runs as before
    with torch.no_grad(), apply_plan(model, plan):
        model(x)  # no recompute or offload without gradients: nothing to refuse


def test_pure_units_with_batchnorm_are_not_refused() -> None:
    model = nn.Sequential(nn.Sequential(_Pure(), _Pure(), _Pure()))
    plan = _hand_plan(model, {"0.0": "offload", "0.1": "recompute", "0.2": "recompute"})
    with apply_plan(model, plan):
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()


def _all(plan: Plan, action: str) -> Plan:
    return _all_by(plan, {u.fqn: action for u in plan.units})


def _hand_plan(model: nn.Module, actions: dict[str, str]) -> Plan:
    x = torch.randn(4, 8)
    profile = profile_step(model, x, torch.zeros(4, 8), F.mse_loss, units=list(actions))
    return _all_by(make_plan(profile, budget_bytes=int(1e12)), actions)


def _all_by(plan: Plan, actions: dict[str, str]) -> Plan:
    units = tuple(
        dataclasses.replace(u, action=actions.get(u.fqn, u.action), segment=-1) for u in plan.units
    )
    return dataclasses.replace(plan, units=units)
