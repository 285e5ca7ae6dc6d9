"""The optimizer on the host under HF Trainer (TRL's SFTTrainer) and Accelerate, with clipping,
gradient accumulation, a cosine schedule with warm-up and weight decay on matrices only, on a
tiny Llama: final parameters, optimizer state, logged losses and ``grad_norm`` (Accelerate:
what ``clip_grad_norm_`` returns) bitwise those of the same run without superneurons, on
one process and on 2 gloo ranks (DDP rebuilt in place), and a run stopped at step 3 and
resumed bitwise the uninterrupted one (tests/host_step_run.py runs them)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import host_step_run
import trl_support
from integrations_support import TinyLM, batch
from superneurons.errors import ConfigError
from superneurons.integrations.accelerate import prepare_superneurons
from superneurons.integrations.host_step import training_step_of
from superneurons.memory.plan import TrainingStep

needs_trl = pytest.mark.skipif(
    importlib.util.find_spec("trl") is None or importlib.util.find_spec("accelerate") is None,
    reason="trl and accelerate not installed (pip install .[trl])",
)
RECORDED = ("losses", "grad_norms", "params", "optimizer_state")


def _check(record: dict[str, Any]) -> None:
    trl = record["trl"]
    assert trl["host"]["host_optimizer"] and trl["resumed"]["host_optimizer"]
    assert max(trl["eager"]["grad_norms"]) > 1.0  # max_grad_norm=1.0 clips some steps
    for key in RECORDED:
        assert trl["host"][key] == trl["eager"][key], key  # the same run, to the bit
        assert trl["resumed"][key] == trl["host"][key], key  # stopped at 3, resumed
    world = record["world_size"]
    assert trl["saved"] == [f"superneurons-host-optimizer-rank{r}.pt" for r in range(world)]
    acc = record["accelerate"]
    assert max(acc["eager"]["norms"]) > 1.0  # max_grad_norm=1.0 clips some steps
    for key in ("losses", "norms", "params", "optimizer_state"):
        assert acc["host"][key] == acc["eager"][key], key
        resumed, host = acc["resumed"][key], acc["host"][key]
        assert resumed == (host[-len(resumed) :] if isinstance(host, list) else host), key
    if world > 1:  # DDP held one parameter while the plan ran, and all of them after
        llama = trl_support.model(len(trl_support.tokenizer()))
        trainable = len([p for p in llama.parameters() if p.requires_grad])
        assert acc["host"]["ddp_ignores"] == trainable - 1
        assert acc["host"]["restored_ignores"] == 0


@pytest.mark.slow
@needs_trl
def test_trainer_and_accelerate_step_on_the_host_bitwise_on_one_process(tmp_path: Path) -> None:
    _check(json.loads(json.dumps(host_step_run.records(tmp_path))))  # as a rank writes it


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("two-rank-runs")
@needs_trl
def test_trainer_and_accelerate_step_on_the_host_bitwise_on_two_gloo_ranks(
    two_rank_runs: Any,
) -> None:
    ranks = two_rank_runs.part("host-step")
    for record in ranks:
        _check(record)
    for key in ("trl", "accelerate"):
        assert ranks[0][key]["host"]["params"] == ranks[1][key]["host"]["params"]


def test_the_loops_clipping_and_accumulation_reach_the_plan() -> None:
    accelerator = SimpleNamespace(gradient_accumulation_steps=4)
    assert training_step_of(accelerator, 0.0, None) == TrainingStep(accumulation_steps=4)
    assert training_step_of(accelerator, 1.0, 1) == TrainingStep(max_grad_norm=1.0)
    assert training_step_of(accelerator, 0.0, 1) is None  # the plain step: plans as before


class _Accelerator:
    """A one-process accelerator, as prepare_superneurons reads it."""

    distributed_type = "NO"
    num_processes = 1
    gradient_accumulation_steps = 1
    sync_gradients = True
    scaler: Any = None

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)


def test_clipping_routes_to_the_host_and_set_up_refuses_what_it_cannot_follow() -> None:
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    accelerator = _Accelerator()
    setup = prepare_superneurons(
        accelerator, model, sample_batch=batch(0), budget_fraction=1.0, optimizer=optimizer,
        strategy="offload+host-optimizer", max_grad_norm=1.0,
    )  # fmt: skip
    assert setup.plan is not None and setup.plan.step == TrainingStep(max_grad_norm=1.0)
    model(**batch(1))["loss"].backward()
    other = torch.nn.Parameter(torch.ones(3))
    other.grad = torch.full((3,), 2.0)
    assert float(accelerator.clip_grad_norm_([other], 1.0)) == pytest.approx(12**0.5)  # its own
    with pytest.raises(ConfigError, match="all at once"):
        accelerator.clip_grad_norm_(list(model.parameters())[:2], 1.0)
    assert float(accelerator.clip_grad_norm_(model.parameters(), 1.0)) > 0  # on the host
    optimizer.step()
    setup.remove()
    assert "clip_grad_norm_" not in vars(accelerator)  # the accelerator's own again
    accelerator.scaler = object()  # fp16 loss scaling
    fresh = TinyLM()
    with pytest.raises(ConfigError, match="fp16"):
        prepare_superneurons(
            accelerator, fresh, sample_batch=batch(0), budget_fraction=1.0,
            optimizer=torch.optim.AdamW(fresh.parameters()), strategy="offload+host-optimizer",
        )  # fmt: skip
