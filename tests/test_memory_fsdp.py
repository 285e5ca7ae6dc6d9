"""Memory plans on a ``fully_shard`` (FSDP2) model, per rank, on 2 gloo ranks.

Properties: the profile leaves the sharded model and its optimizer untouched; every rank runs
the same plan; the per-rank peak the CPU allocator measures stays within the budget at 60% of
the eager peak and at the reported recompute floor; parameters after the steps are bitwise
those of FSDP2 eager; what a sharded model cannot run is refused on every rank, without a hang.
The tracker follows ``storage.resize_`` (FSDP2's free and re-allocation of unsharded
parameters) exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import Ranks, shared_ranks
from superneurons.errors import ConfigError
from superneurons.memory import tracker as tracking
from superneurons.memory.tracker import LiveStorageTracker

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 128, 256, 2


@pytest.fixture(scope="module")
def ranks() -> Ranks:
    """One 2-rank gloo group shared by the test modules (starting ranks costs seconds)."""
    return shared_ranks(2)


def _sharded() -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _batch(rank: int, step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(
        0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step + 7 * rank)
    )
    return {"input_ids": ids, "labels": ids.clone()}


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    optimizer.step()


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the tensor itself otherwise)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _shards(model: nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def _measured(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank: int
) -> tuple[int, int, int, list[torch.Tensor]]:
    """A step, then the per-rank peak of a second one: the c10 CPU allocator's (resident state
    included) with the bytes whose free its profiler missed, and the live-storage tracker's
    (which sees frees on every thread); and the shards after those steps."""
    from superneurons.bench.memory.meter import allocator_step_bytes, device_peak_bytes

    _step(model, optimizer, _batch(rank, 0))
    batch = _batch(rank, 1)

    def resident() -> list[torch.Tensor]:
        state = [t for s in optimizer.state.values() for t in s.values()]
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return [*model.parameters(), *grads, *state, *batch.values()]

    # NOTE: a gloo worker thread sometimes frees a collective's buffer where the profiler does
    # not see it (``unfreed`` > 0, the peak over-counted): every rank measures such a step again
    shards: list[torch.Tensor] = []
    for _ in range(4):
        peak, unfreed = allocator_step_bytes(
            lambda: _step(model, optimizer, batch), resident=resident
        )
        shards = shards or _shards(model)
        seen = torch.tensor([unfreed])
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        if int(seen) == 0:
            break
    tracked = device_peak_bytes(lambda: _step(model, optimizer, batch), resident=resident())
    return peak, unfreed, tracked, shards


def _budgets(rank: int, world_size: int) -> dict[str, Any]:
    from superneurons.integrations.hf import plan_for_batch
    from superneurons.memory import InfeasibleBudgetError, apply_plan

    model, optimizer = _sharded()
    eager_peak, _, _, eager = _measured(model, optimizer, rank)
    out: dict[str, Any] = {"eager_peak": eager_peak}
    for name in ("60%", "floor"):
        model, optimizer = _sharded()
        before = _shards(model)
        if name == "60%":
            plan = plan_for_batch(
                model, _batch(rank, 0), budget_fraction=0.6, optimizer=optimizer, keep_outputs=False
            )
        else:
            with pytest.raises(InfeasibleBudgetError) as info:
                plan_for_batch(
                    model, _batch(rank, 0), budget_bytes=1, optimizer=optimizer, keep_outputs=False
                )
            floor = info.value.min_budget_bytes
            plan = plan_for_batch(
                model, _batch(rank, 0), budget_bytes=floor, optimizer=optimizer, keep_outputs=False
            )
        untouched = all(torch.equal(a, b) for a, b in zip(before, _shards(model), strict=True))
        untouched &= not optimizer.state and all(p.grad is None for p in model.parameters())
        with apply_plan(model, plan):
            peak, unfreed, tracked, shards = _measured(model, optimizer, rank)
        out[name] = {
            "plan": plan.to_json(),
            "budget": plan.budget_bytes,
            "predicted": plan.predicted_peak_bytes,
            "measured": peak,
            "unfreed": unfreed,
            "tracked": tracked,
            "untouched": untouched,
            "bitwise": all(torch.equal(a, b) for a, b in zip(eager, shards, strict=True)),
            "recompute": plan.count("recompute"),
            "actions": [(u.fqn, u.action, u.segment) for u in plan.units],
        }
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_plans_fit_the_budget_per_rank_and_train_as_fsdp2_eager(ranks: Ranks) -> None:
    results = ranks.run(_budgets, timeout_s=240)
    for result in results:
        for name in ("60%", "floor"):
            row = result[name]
            shown = f"{name}: " + str({k: v for k, v in row.items() if k != "plan"})
            assert row["untouched"], shown  # profiling changed no shard, gradient or state
            assert row["bitwise"], shown  # parameters after two steps equal FSDP2 eager's
            assert row["recompute"] > 0, shown
            # the per-rank peak, as the tracker sees it (frees on every thread), fits the budget
            # and is the prediction within 0.5%
            assert row["tracked"] <= row["budget"], shown
            assert abs(row["tracked"] - row["predicted"]) <= 0.005 * row["predicted"], shown
            # the allocator's view too, less the bytes whose free its profiler missed (0 in
            # most steps: then it is the prediction within 0.5%)
            assert row["measured"] - row["unfreed"] <= row["budget"], shown
            if row["unfreed"] == 0:
                assert abs(row["measured"] - row["predicted"]) <= 0.005 * row["predicted"], shown
        assert result["floor"]["budget"] < result["60%"]["budget"] < result["eager_peak"]
    for name in ("60%", "floor"):  # every rank runs the same plan
        assert results[0][name]["plan"] == results[1][name]["plan"]


def _refusals(rank: int, world_size: int) -> list[str]:
    """The refusals, after profiling a model that trained a step (its shards, gradients and
    optimizer state are left exactly as they were)."""
    from superneurons.integrations.hf import plan_for_batch
    from superneurons.memory import apply_plan
    from superneurons.memory.fsdp import agree_plan

    model, optimizer = _sharded()
    messages = []
    with pytest.raises(ConfigError) as info:
        plan_for_batch(model, _batch(rank, 0), budget_fraction=0.6, strategy="offload")
    messages.append(str(info.value))
    _step(model, optimizer, _batch(rank, 0))  # a trained model: optimizer state in DTensors
    state = [_plain(t).clone() for s in optimizer.state.values() for t in s.values()]
    before, grads = _shards(model), [p.grad for p in model.parameters()]
    plan = plan_for_batch(
        model, _batch(rank, 1), budget_fraction=0.6, optimizer=optimizer, keep_outputs=False
    )
    after = [_plain(t) for s in optimizer.state.values() for t in s.values()]
    assert all(torch.equal(a, b) for a, b in zip(before, _shards(model), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(state, after, strict=True))
    assert all(a is p.grad for a, p in zip(grads, model.parameters(), strict=True))
    offloading = type(plan).from_json(plan.to_json().replace('"recompute"', '"offload"'))
    with pytest.raises(ConfigError) as info:
        apply_plan(model, offloading)
    messages.append(str(info.value))
    mine = plan if rank == 0 else dataclasses.replace(plan, units=plan.units[:1])
    with pytest.raises(ConfigError) as info:  # ranks that planned other units: both raise
        agree_plan(mine)
    messages.append(str(info.value))
    failed = ConfigError("no room") if rank == 1 else None
    with pytest.raises(ConfigError) as info:  # one rank failed to plan: both raise
        agree_plan(None if failed else plan, error=failed)
    messages.append(str(info.value))
    return messages


@pytest.mark.dist
def test_what_a_sharded_model_cannot_run_is_refused_on_every_rank(ranks: Ranks) -> None:
    for messages in ranks.run(_refusals, timeout_s=60):
        offload_strategy, offload_plan, units, failed = messages
        assert "strategy 'offload'" in offload_strategy and "'recompute'" in offload_strategy
        assert "offloads" in offload_plan and "strategy='recompute'" in offload_plan
        assert "planned other units" in units
        assert "no room" in failed


def test_tracker_follows_storage_resizes_exactly() -> None:
    """FSDP2 frees an unsharded parameter with ``resize_(0)`` and re-allocates it with
    ``resize_(n)``: neither reaches the dispatcher; the tracker still sees both."""
    tensor = torch.empty(1000)  # 4000 B
    tracker = LiveStorageTracker()
    tracker.register([tensor])
    storage = tensor.untyped_storage()
    with tracker:
        storage.resize_(0)
        assert tracker.live_bytes == 0
        storage.resize_(4000)
        out = tensor + 1  # a new 4000 B storage
        assert tracker.live_bytes == 8000
        assert tracker.serial_of(tensor) is not None
        first, second = 0, tracker.serial_of(tensor)
        assert tracker.lineage[second] == first and tracker.deaths[first] == -1
    assert tracker.peak_bytes == 8000 and out.numel() == 1000
    assert torch.UntypedStorage.resize_ is tracking._ORIGINAL_RESIZE  # the patch is gone
    storage.resize_(0)  # outside the block: not seen
    assert tracker.live_bytes == 8000
