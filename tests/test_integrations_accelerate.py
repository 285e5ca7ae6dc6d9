"""prepare_superneurons after accelerate's prepare: both halves on 2 gloo ranks, the refusals,
and the Accelerate example."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed import Ranks, shared_ranks
from integrations_support import TinyLM, batch, check_example_ranks, torchrun
from sentinel import assert_same, training_state
from superneurons.errors import ConfigError
from superneurons.integrations.accelerate import prepare_superneurons


class _Accelerator:
    """What prepare_superneurons reads from an ``accelerate.Accelerator``."""

    def __init__(self, kind: str = "MULTI_CPU", processes: int = 2, hook: Any = None) -> None:
        self.distributed_type = kind
        self.num_processes = processes
        self.ddp_handler = SimpleNamespace(comm_hook=hook) if hook is not None else None


def _train(rank: int, *, plan: bool, steps: int = 3) -> tuple[list[torch.Tensor], Any]:
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyLM())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    setup = prepare_superneurons(
        _Accelerator(),
        model,
        compression="topk:ratio=0.1",
        sample_batch=batch(100 + rank),
        budget_fraction=0.9 if plan else None,
        strategy="checkpoint",
        optimizer=optimizer,
    )
    for step in range(steps):
        torch.manual_seed(10 * step + rank)  # dropout: per rank, the same with and without plan
        optimizer.zero_grad()
        model(**batch(1000 * rank + step))["loss"].backward()
        optimizer.step()
    stats = setup.plan_handle.stats() if setup.plan_handle else None
    setup.remove()
    return [p.detach().clone() for p in model.parameters()], (setup, stats)


def _both_halves(rank: int, world_size: int) -> dict[str, Any]:
    params, (setup, stats) = _train(rank, plan=True)
    reference, _ = _train(rank, plan=False)
    state = setup.compression
    return {
        "params": params,
        "equal_to_unplanned": all(
            torch.equal(a, b) for a, b in zip(params, reference, strict=True)
        ),
        "plan": setup.plan.to_json(),
        "sent": state.bytes_sent_total,
        "dense": state.dense_bytes_step * state.step,
        "steps": state.step,
        "recompute": {k: v["recompute_calls"] for k, v in stats["recompute"].items()},
        "use_cache": setup.plan_handle.model.config.use_cache,
    }


def _infeasible(rank: int, world_size: int) -> str:
    model = DistributedDataParallel(TinyLM())
    try:
        prepare_superneurons(_Accelerator(), model, sample_batch=batch(rank), budget_bytes=1)
    except ConfigError as exc:
        return str(exc)
    return "no error"


@pytest.fixture(scope="module")
def ranks() -> Ranks:
    return shared_ranks(2)


@pytest.mark.dist
def test_plan_and_compression_on_two_ranks(ranks: Ranks) -> None:
    results = ranks.run(_both_halves, timeout_s=120)
    assert results[0]["plan"] == results[1]["plan"]  # rank 0's plan, broadcast
    for r in results:
        assert r["equal_to_unplanned"]  # the plan changes memory, not numbers
        assert r["steps"] == 3 and 0 < r["sent"] < r["dense"]
        assert {"blocks.0", "blocks.1", "blocks.2"} <= set(r["recompute"])  # + stem and head
        assert set(r["recompute"].values()) == {3}  # once per step
        assert r["use_cache"] is True  # restored by remove()
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.dist
def test_infeasible_budget_fails_on_every_rank(ranks: Ranks) -> None:
    messages = ranks.run(_infeasible, timeout_s=60)
    assert "budget" in messages[0]
    assert messages[1].startswith("rank 0 could not plan")


def test_refusals_before_anything_runs() -> None:
    model = TinyLM()
    with pytest.raises(ConfigError, match="sample_batch"):
        prepare_superneurons(_Accelerator(), model, budget_fraction=0.5)
    with pytest.raises(ConfigError, match="FSDP"):
        prepare_superneurons(_Accelerator("FSDP"), model, compression="fp16")
    with pytest.raises(ConfigError, match="not DistributedDataParallel"):
        prepare_superneurons(_Accelerator(), model, compression="fp16")
    with pytest.raises(ConfigError, match="one hook"):
        hook = SimpleNamespace(value="fp16")
        prepare_superneurons(_Accelerator(hook=hook), _FakeDDP(model), compression="fp16")
    single = prepare_superneurons(_Accelerator(processes=1), model, compression="fp16")
    assert single.compression is None  # one process: nothing to average


class _FakeDDP(DistributedDataParallel):
    """A DDP instance without a process group (only its type matters to the checks)."""

    def __init__(self, module: nn.Module) -> None:  # noqa: D107 - skip DDP's collective init
        nn.Module.__init__(self)
        self.module = module


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="no accelerate")
def test_planning_leaves_the_prepared_run_as_it_was() -> None:
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.backward(model(**batch(0))["loss"])
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    before = training_state(model, optimizer, scheduler)
    assert before["optimizer"]["state"]  # AcceleratedOptimizer around AdamW, with state
    setup = prepare_superneurons(
        accelerator, model, sample_batch=batch(1), budget_fraction=0.8, optimizer=optimizer,
        strategy="checkpoint",
    )  # fmt: skip
    assert_same(before, training_state(model, optimizer, scheduler))
    assert setup.plan is not None and setup.plan.count("recompute") == len(setup.plan.units)
    setup.remove()


@pytest.mark.dist
@pytest.mark.slow  # torchrun and two ranks, each importing torch: ~30 s of CPU
@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="no accelerate")
def test_accelerate_example_on_two_gloo_ranks(tmp_path: Path) -> None:
    result = torchrun("examples/accelerate_ddp.py", tmp_path, "--steps", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    record = check_example_ranks(tmp_path)
    assert record["steps"] == 3
