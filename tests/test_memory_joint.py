"""The joint action ``recompute+offload`` (SuperNeurons: checkpoints in the host pool, cheap layers
recomputed): gradients bitwise equal to eager, BatchNorm statistics updated once, dropout RNG kept,
the pool holds exactly the checkpoints the plan names and returns every byte, and every plan the
planner returns on the zoo models stays within its budget when the runtime executes it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from superneurons.bench.memory.meter import device_peak_bytes
from superneurons.errors import ConfigError
from superneurons.memory.offload.pool import PoolConfig
from superneurons.memory.plan import Plan, UnitDecision
from superneurons.memory.planner.bounds import (
    LOSS,
    largest_unit_bytes,
    resident_bytes,
    working_sets,
)
from superneurons.memory.planner.decide import make_plan, min_peak_bytes
from superneurons.memory.profiling.step import profile_step
from superneurons.memory.runtime.apply import apply_plan
from superneurons.memory.sizing.simulate import simulate_plan
from superneurons.models.zoo import build_model, default_loss, model_input

ALL_BYTES = PoolConfig(min_offload_bytes=0)
TINY_RESNET = {"layers": (1, 1, 1, 1), "width": 4, "num_classes": 10, "small_input": True}
TINY_GPT = {"n_layer": 3, "n_head": 2, "n_embd": 16, "block_size": 16, "dropout": 0.1}


def _joint_plan(model: nn.Module, units: list[str]) -> Plan:
    """recompute+offload everywhere the profile allows it (in-place units: offload)."""
    profile = profile_step(model, *_batch(model), _loss(model), None, fake=True, units=units)
    inplace = {u.fqn for u in profile.units if u.inplace}
    decisions = tuple(
        UnitDecision(f, "offload" if f in inplace else "recompute+offload") for f in units
    )
    return Plan(units=decisions, strategy="offload", budget_bytes=1 << 40)


def _batch(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    name = "gpt" if hasattr(model, "transformer") else "resnet"
    kwargs = TINY_GPT if name == "gpt" else TINY_RESNET
    extra = {} if name == "gpt" else {"image_size": 8}
    return model_input(name, 2, generator=torch.Generator().manual_seed(0), **kwargs, **extra)


def _loss(model: nn.Module):  # type: ignore[no-untyped-def]
    return default_loss("gpt" if hasattr(model, "transformer") else "resnet")


def _train(model: nn.Module, steps: int = 3) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i in range(steps):
        torch.manual_seed(100 + i)  # dropout masks from the same RNG stream
        opt.zero_grad()
        _loss(model)(model(_batch(model)[0]), _batch(model)[1]).backward()
        opt.step()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("name", ["resnet", "gpt"])
def test_joint_action_bitwise_equal_eager_bn_once_dropout_kept(name: str) -> None:
    from superneurons.memory.profile_types import default_units

    model = build_model(name, **(TINY_GPT if name == "gpt" else TINY_RESNET))
    units = default_units(model)  # blocks + stem + head: the whole step
    plan = _joint_plan(model, units)
    assert plan.count("recompute+offload") >= 4
    ref, planned = copy.deepcopy(model), copy.deepcopy(model)
    grads_ref = _train(ref)
    with apply_plan(planned, plan, pool_config=ALL_BYTES) as handle:
        grads = _train(planned)
        stats = handle.stats()
    for a, b in zip(grads_ref, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # bitwise: CPU fp32, same RNG
    for (key, a), (_, b) in zip(
        ref.state_dict().items(), planned.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=key)  # BN stats: updated once
    blocks = [f for f in stats["recompute"] if f.startswith(("layer", "transformer.h."))]
    assert len(blocks) >= 3
    for fqn, counts in stats["recompute"].items():
        assert counts["forward_calls"] == 3, fqn
        # once per step, or never for a unit that saves nothing to recompute (a pooling)
        assert counts["recompute_calls"] == (3 if fqn in blocks else counts["recompute_calls"])
        assert counts["recompute_calls"] in (0, 3), fqn
    assert stats["pool"]["d2h_bytes"] > 0


class Chain(nn.Module):
    def __init__(self, width: int = 64, blocks: int = 6) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, width)
        return self.blocks(x * 1.0).sum()


def test_host_pool_holds_exactly_the_named_checkpoints_and_returns_every_byte() -> None:
    model, x = Chain(), torch.randn(32, 64)
    units = [f"blocks.{i}" for i in range(6)]
    joint = {"blocks.1", "blocks.2", "blocks.4"}
    actions = ["recompute+offload" if u in joint else "keep" for u in units]
    plan = Plan(
        units=tuple(UnitDecision(u, a) for u, a in zip(units, actions, strict=True)),
        strategy="offload",
        budget_bytes=1 << 40,
    )
    with apply_plan(model, plan, pool_config=ALL_BYTES) as handle:
        loss = model(x)
        stats = handle.pool.stats()
        # one checkpoint (the block's input, 32 x 64 fp32) per joint unit, nothing else
        assert stats.host_bytes == len(joint) * x.numel() * 4
        assert stats.d2h_count == len(joint) and stats.device_bytes == 0
        loss.backward()
        stats = handle.pool.stats()
        assert (stats.host_bytes, stats.device_bytes, stats.live_slots) == (0, 0, 0)
        assert stats.h2d_count + stats.still_resident == len(joint)
        assert stats.demand_fetches <= 1  # the last one in backward is fetched on entry


def test_joint_action_lowers_the_measured_peak_below_checkpointing() -> None:
    model, x = Chain(width=256, blocks=8), torch.randn(512, 256)
    units = [f"blocks.{i}" for i in range(8)]

    def peak(action: str) -> int:
        plan = Plan(
            units=tuple(UnitDecision(u, action) for u in units),
            strategy="offload",
            budget_bytes=1 << 40,
        )
        with apply_plan(model, plan, pool_config=ALL_BYTES) as handle:
            model(x).backward()  # warm-up: the host slab has its size
            return device_peak_bytes(
                lambda: model(x).backward(),
                resident=list(model.parameters()),
                host=handle.pool.host_buffers(),
            )

    # checkpointing holds 8 block inputs when backward starts, on top of the last block's
    # recompute; the joint action holds at most the recomputed block's and the prefetched
    # one's, but its peak may move into a block's forward or backward (~3 activations here)
    act_bytes = x.numel() * 4
    assert peak("recompute+offload") <= peak("recompute") - 2 * act_bytes


ZOO = [
    ("resnet", {**TINY_RESNET, "width": 8}, 16, 4),
    pytest.param("resnet50", {}, 32, 2, marks=pytest.mark.slow),
    ("gpt", {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64, "vocab_size": 512}, 0, 2),
]


@pytest.mark.parametrize(
    ("name", "kwargs", "image_size", "batch"), ZOO, ids=["resnet", "resnet50", "gpt"]
)
def test_every_plan_the_planner_returns_fits_when_executed(
    name: str, kwargs: dict, image_size: int, batch: int
) -> None:
    """Budgets from eager down to each strategy's minimum; each plan executed by the runtime
    (``simulate_plan``: apply_plan on fake tensors, live storages counted)."""
    extra = {"image_size": image_size} if image_size else {}
    model = build_model(name, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = model_input(name, batch, **kwargs, **extra)
    loss_fn = default_loss(name)
    profile = profile_step(model, x, y, loss_fn, opt, fake=True)
    eager = profile.predicted_peak_bytes()
    minima = min_peak_bytes(profile)
    checked = 0
    for strategy in ("checkpoint", "recompute", "offload", "offload+opt-in-backward"):
        for budget in sorted({minima[strategy], (minima[strategy] + eager) // 2}):
            try:
                plan = make_plan(profile, budget_bytes=budget, strategy=strategy)
            except ConfigError:
                continue
            measured = simulate_plan(model, x, y, loss_fn, opt, plan).measured_peak_bytes
            assert measured <= budget, (strategy, budget, measured)
            assert abs(measured - plan.predicted_peak_bytes) <= 0.03 * measured, (strategy, budget)
            checked += 1
    assert checked >= 6


def test_bounds_name_the_loss_and_resident_state() -> None:
    model = build_model("gpt", n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=2048)
    x, y = model_input("gpt", 2, n_layer=2, n_embd=32, block_size=32, vocab_size=2048)
    opt = torch.optim.AdamW(model.parameters())
    profile = profile_step(model, x, y, default_loss("gpt"), opt, fake=True)
    sets = working_sets(profile)
    logits_bytes = 2 * 32 * 2048 * 4
    # the cross-entropy holds logits-sized buffers (log-softmax output, its gradient, ...)
    assert sets[LOSS] >= 2 * logits_bytes
    assert largest_unit_bytes(profile) == max(sets.values())
    params = sum(p.numel() * 4 for p in model.parameters())
    # params, grads, AdamW's two moments (and its per-parameter step counters)
    steps = sum(1 for _ in model.parameters())
    assert 4 * params <= resident_bytes(profile) <= 4 * params + 8 * steps
    plan = make_plan(profile, budget_bytes=profile.predicted_peak_bytes(), strategy="auto")
    assert plan.strategy == "eager"  # auto names the strategy it chose
    assert plan.resident_bytes == resident_bytes(profile)


def test_in_place_units_are_never_recomputed() -> None:
    model = build_model("resnet", **TINY_RESNET)
    x, y = model_input("resnet", 2, image_size=8, **TINY_RESNET)
    profile = profile_step(model, x, y, F.cross_entropy, None, fake=True)
    inplace = {u.fqn for u in profile.units if u.inplace}
    assert "relu" in inplace  # the stem's ReLU(inplace=True)
    for strategy in ("checkpoint", "offload"):
        plan = make_plan(profile, budget_bytes=min_peak_bytes(profile)[strategy], strategy=strategy)
        assert all(plan.action_of(f) in ("keep", "offload") for f in inplace)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pinned_pool_prefetch_overlaps_compute() -> None:
    """Joint action on CUDA: prefetches hit (no demand fetch stalls backward) and a step with
    prefetch is faster than one that fetches on demand (copies overlap compute; events)."""
    device = torch.device("cuda")
    model, x = Chain(width=2048, blocks=12).to(device), torch.randn(4096, 2048, device=device)
    units = [f"blocks.{i}" for i in range(12)]
    plan = Plan(
        units=tuple(UnitDecision(u, "recompute+offload") for u in units),
        strategy="offload",
        budget_bytes=1 << 40,
    )

    def step_ms(config: PoolConfig) -> tuple[float, dict]:
        with apply_plan(model, plan, pool_config=config) as handle:
            model(x).backward()  # warm-up (slab sized, kernels loaded)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                model(x).backward()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 3, handle.pool.stats().__dict__

    with_prefetch, stats = step_ms(PoolConfig(min_offload_bytes=0, prefetch=True))
    on_demand, _ = step_ms(PoolConfig(min_offload_bytes=0, prefetch=False))
    assert stats["prefetch_hits"] > 0 and stats["demand_fetches"] <= 4  # one per step at most
    assert with_prefetch < on_demand


def test_device_presets_and_measured_copy_bandwidth() -> None:
    from superneurons.memory.planner.cost import DEVICE_PRESETS, cost_model, measure_copy_bandwidth

    assert set(DEVICE_PRESETS) == {"h100", "a100", "a100-80gb", "rtx4090", "cpu"}
    h100 = cost_model("h100")
    assert h100.memory_bytes == 80 * 2**30 and cost_model("rtx4090").memory_bytes == 24 * 2**30
    assert h100.fetch_s(54_600_000_000) == pytest.approx(1.0)  # measured on an H100: 54.6 GB/s back
    assert h100.copy_s(41_700_000_000) == pytest.approx(1.0)  # and 41.7 GB/s to the host
    assert cost_model("a100", bandwidth_bytes_per_s=1e9).bandwidth_bytes_per_s == 1e9
    with pytest.raises(ConfigError):
        cost_model("tpu")
    d2h, h2d = measure_copy_bandwidth("cpu", nbytes=1 << 20, repeats=2)
    assert d2h > 0 and h2d > 0
