"""Ranks that hold different state after setup are stopped with a named tensor: the check
itself, and in the Accelerate, Lightning and CLI-trainer integrations (2 gloo ranks; the HF
callback's is in test_integrations_trl)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed import Ranks, shared_ranks
from integrations_support import TinyLM, batch
from sentinel import assert_same, training_state
from superneurons.errors import ReplicaMismatchError
from superneurons.replicas import check_replicas, fingerprints
from train_support import mlp_config, needs_data


def test_fingerprints_see_one_bit_and_swapped_elements() -> None:
    model = nn.Linear(64, 64)
    base = fingerprints(model)
    assert fingerprints(model) == base  # deterministic
    with torch.no_grad():
        model.weight.view(-1).view(torch.int32)[7] ^= 1  # one bit of one element
    assert fingerprints(model)["weight"] != base["weight"]
    assert fingerprints(model)["bias"] == base["bias"]
    with torch.no_grad():
        model.weight.view(-1).view(torch.int32)[7] ^= 1
        model.bias[[0, 1]] = model.bias[[1, 0]].clone()  # same values, other places
    assert fingerprints(model)["weight"] == base["weight"]
    assert fingerprints(model)["bias"] != base["bias"]


def test_optimizer_state_and_hyper_parameters_are_fingerprinted() -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    base = fingerprints(model, optimizers=[optimizer])
    assert "optimizer.state[weight].exp_avg" in base and "optimizer.param_groups[0]" in base
    optimizer.param_groups[0]["lr"] = 2e-3
    changed = fingerprints(model, optimizers=[optimizer])
    assert [k for k in base if base[k] != changed[k]] == ["optimizer.param_groups[0]"]


def test_without_a_process_group_it_is_a_no_op() -> None:
    check_replicas(nn.Linear(2, 2))


def _nudge(model: nn.Module) -> None:
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-3


def _check(rank: int, world_size: int, where: str) -> str:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(TinyLM())
    optimizer = torch.optim.AdamW(ddp.parameters())
    ddp(**batch(rank))["loss"].backward()
    optimizer.step()
    if rank == 1 and where == "param":
        _nudge(ddp.module)
    if rank == 1 and where == "state":
        optimizer.state[ddp.module.head.weight]["exp_avg"][0, 0] += 1.0
    try:
        check_replicas(ddp, optimizers=[optimizer], process_group=ddp.process_group)
    except ReplicaMismatchError as exc:
        return str(exc)
    return "ok"


@pytest.fixture(scope="module")
def ranks() -> Ranks:
    return shared_ranks(2)


@pytest.mark.dist
def test_ranks_agree_or_every_rank_names_the_tensor(ranks: Ranks) -> None:
    assert ranks.run(_check, "none") == ["ok", "ok"]
    for where, name in (("param", "'embed.weight'"), ("state", "optimizer.state[head.weight]")):
        messages = ranks.run(_check, where)
        assert messages[0] == messages[1]  # every rank raises, none is left waiting
        assert name in messages[0] and "rank 0 and rank 1" in messages[0]


class _Accelerator:
    distributed_type = "MULTI_CPU"
    num_processes = 2
    ddp_handler = None


def _accelerate(rank: int, world_size: int) -> str:
    from superneurons.integrations.accelerate import prepare_superneurons

    torch.manual_seed(0)
    ddp = DistributedDataParallel(TinyLM())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    if rank == 1:
        _nudge(ddp.module)  # after DDP's broadcast: only a check can see it now
    try:
        prepare_superneurons(
            _Accelerator(), ddp, compression="topk:ratio=0.1", sample_batch=batch(rank),
            budget_fraction=0.9, optimizer=optimizer,
        )  # fmt: skip
    except ReplicaMismatchError as exc:
        return str(exc)
    return "ok"


@pytest.mark.dist
def test_accelerate_setup_catches_a_nudged_rank(ranks: Ranks) -> None:
    messages = ranks.run(_accelerate, timeout_s=120)
    assert messages[0] == messages[1] and "'embed.weight'" in messages[0]


def _lightning(rank: int, world_size: int, nudge: bool) -> str:
    from superneurons.integrations.lightning import CompressedDDPStrategy

    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    strategy = CompressedDDPStrategy("topk:ratio=0.5")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ddp.module(torch.ones(2, 8)).sum().backward()  # not through DDP: hooks come first
    optimizer.step()  # momentum buffers exist
    before = training_state(ddp.module, optimizer)
    strategy.model = ddp  # what DDPStrategy.setup sets before on_train_start
    strategy.optimizers = [optimizer]
    strategy._register_ddp_hooks()
    if nudge and rank == 1:
        _nudge(ddp.module)
    try:
        strategy.on_train_start()
    except ReplicaMismatchError as exc:
        return str(exc)
    # the sentinel: registering the hook and checking left the run as it was
    assert_same(before, training_state(ddp.module, optimizer))
    return "ok"


@pytest.mark.dist
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="no lightning")
def test_lightning_strategy_catches_a_nudged_rank(ranks: Ranks) -> None:
    assert ranks.run(_lightning, False) == ["ok", "ok"]
    messages = ranks.run(_lightning, True)
    assert messages[0] == messages[1] and "'0.weight'" in messages[0]


def _cli(rank: int, world_size: int, out_dir: str) -> str:
    from superneurons.train import loop

    attach = loop.attach_synchronisation

    def nudged(config: Any, model: nn.Module, ddp: Any, **kwargs: Any) -> Any:
        result = attach(config, model, ddp, **kwargs)
        if rank == 1:
            _nudge(model)  # after DDP's broadcast
        return result

    loop.attach_synchronisation = nudged  # type: ignore[assignment]
    try:
        loop.run_training(mlp_config(Path(out_dir)), torch.device("cpu"))
    except ReplicaMismatchError as exc:
        return str(exc)
    finally:
        loop.attach_synchronisation = attach
    return "ok"


@pytest.mark.dist
@needs_data
def test_cli_trainer_catches_a_nudged_rank(ranks: Ranks, tmp_path: Path) -> None:
    messages = ranks.run(_cli, str(tmp_path), timeout_s=120)
    assert messages[0] == messages[1] and "differs between rank 0 and rank 1" in messages[0]
