"""Memory plans for HF-style models (``model(**batch).loss``), and the transformers.Trainer
example on 2 gloo ranks."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from integrations_support import TinyLM, batch, check_example_ranks, torchrun
from superneurons.errors import ConfigError
from superneurons.integrations.hf import plan_for_batch, training_without_kv_cache
from superneurons.memory import apply_plan
from superneurons.memory.profile_types import ALLOCATOR_MARGIN_BYTES

needs_hf = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers not installed"
)


def _grads(model: torch.nn.Module, data: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # the same dropout masks in both runs
    model(**data)["loss"].backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_plan_names_units_of_the_model_itself() -> None:
    model = TinyLM()
    plan = plan_for_batch(model, batch(0), budget_fraction=1.0)
    units = [u.fqn for u in plan.units]  # the whole step: embedding, blocks and head
    assert units == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert plan.tensors and not any(t.key.startswith("model.") for t in plan.tensors)
    assert {t.unit for t in plan.tensors} <= {"", *units}


def test_plan_fits_its_budget_and_keeps_gradients_exact() -> None:
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters())
    data = batch(1)
    eager = plan_for_batch(model, data, budget_fraction=1.0, optimizer=optimizer)
    plan = plan_for_batch(
        model, data, budget_fraction=0.8, optimizer=optimizer, strategy="checkpoint"
    )
    assert plan.count("recompute") == len(plan.units)  # every unit, stem and head included
    assert plan.budget_bytes == int(0.8 * eager.predicted_peak_bytes)
    assert plan.predicted_peak_bytes <= plan.budget_bytes < eager.predicted_peak_bytes
    assert not optimizer.state  # the profile stepped a copy
    expected = _grads(model, data)
    with apply_plan(model, plan) as handle:
        got = _grads(model, data)
    assert all(s.recompute_calls == 1 for s in handle.recompute_stats.values())
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_budgets_and_batches_are_refused() -> None:
    model = TinyLM()
    with pytest.raises(ConfigError, match="exactly one"):
        plan_for_batch(model, batch(0))
    with pytest.raises(ConfigError, match="exactly one"):
        plan_for_batch(model, batch(0), budget_bytes=10**9, budget_fraction=0.5)
    for fraction in (0.0, 1.5):
        with pytest.raises(ConfigError, match=r"\(0, 1\]"):
            plan_for_batch(model, batch(0), budget_fraction=fraction)
    with pytest.raises(ConfigError, match="dict"):
        plan_for_batch(model, [batch(0)["input_ids"]], budget_fraction=0.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="labels"):
        plan_for_batch(model, {"input_ids": batch(0)["input_ids"]}, budget_fraction=0.5)


def test_kv_cache_is_off_while_training_and_restored() -> None:
    model = TinyLM()
    with training_without_kv_cache(model) as previous:
        assert previous is True and model.config.use_cache is False
    assert model.config.use_cache is True
    with training_without_kv_cache(torch.nn.Linear(2, 2)) as previous:  # no config: a no-op
        assert previous is False


@pytest.mark.dist
@pytest.mark.slow  # torchrun and two ranks, each importing torch: ~30 s of CPU
@needs_hf
def test_trainer_example_plans_and_compresses_on_two_gloo_ranks(tmp_path: Path) -> None:
    result = torchrun(
        "examples/hf_trainer.py",
        tmp_path,
        "--steps",
        "3",
        "--strategy",
        "checkpoint",
        "--repeat",
        "2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    record = check_example_ranks(tmp_path)
    assert set(record["plan"].values()) == {"recompute"}
    stats = record["plan_stats"]["recompute"]
    assert record["steps"] == 6  # two train() calls of 3 steps, one hook
    assert all(s["recompute_calls"] == 3 for s in stats.values())  # the second plan's


def _trainer_params(tmp_path: Path, *, callback: bool) -> tuple[list[torch.Tensor], object]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from superneurons.integrations.transformers import SuperNeuronsCallback

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (16, 32), generator=torch.Generator().manual_seed(1))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=[{"input_ids": x, "labels": x} for x in ids]
    )
    use_cache = model.config.use_cache  # transformers 5 sets args.use_cache (False) here
    hook = None
    if callback:
        hook = SuperNeuronsCallback(trainer, budget_fraction=1.0, strategy="checkpoint")
        trainer.add_callback(hook)
    trainer.train()
    trainer.train()  # again: the plan is applied anew, the model restored after each
    assert model.config.use_cache is use_cache
    return [p.detach().clone() for p in model.parameters()], hook


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("two-rank-runs")
@needs_hf
def test_trainer_resume_restores_compression_state_bit_exactly(two_rank_runs: Any) -> None:
    ranks = two_rank_runs.part("hf-resume")
    assert ranks[0] == ranks[1]
    record = ranks[0]
    assert record["saved"] == [f"superneurons-compression-rank{r}.pt" for r in (0, 1)]
    assert record["resumed"] == record["uninterrupted"]
    # the saved residuals matter: without them the resumed run takes another path
    assert record["resumed_without_state"] != record["uninterrupted"]


@needs_hf
def test_trainer_callback_plans_without_changing_the_numbers(tmp_path: Path) -> None:
    expected, _ = _trainer_params(tmp_path / "eager", callback=False)
    got, hook = _trainer_params(tmp_path / "planned", callback=True)
    setup = hook.setup  # type: ignore[attr-defined]
    assert setup.compression is None  # one process: nothing to average
    assert setup.plan.count("recompute") == len(setup.plan.units)  # "checkpoint": every unit
    assert all(s.recompute_calls == 2 for s in setup.plan_handle.recompute_stats.values())
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_trainer_callback_refuses_a_compiled_trainer_before_any_work() -> None:
    from types import SimpleNamespace

    from superneurons.integrations.transformers import SuperNeuronsCallback

    trainer = SimpleNamespace(accelerator=object())  # never reached: refused first
    callback = SuperNeuronsCallback(trainer, budget_fraction=0.6)
    args = SimpleNamespace(torch_compile=True, device="cpu")
    with pytest.raises(ConfigError, match="torch_compile=False"):
        callback.on_train_begin(args, SimpleNamespace(global_step=0), None)
    assert callback.setup is None


@pytest.mark.cuda
def test_plan_for_batch_on_cuda_keeps_gradients_exact() -> None:
    model = TinyLM().cuda()
    data = {k: v.cuda() for k, v in batch(3).items()}
    plan = plan_for_batch(model, data, budget_fraction=1.0, strategy="offload")
    expected = _grads(model, data)
    with apply_plan(model, plan):
        got = _grads(model, data)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _hf_step_peak(*, use_cache: bool) -> tuple[int, int]:
    """(predicted, measured) peak bytes of a steady-state step of a tiny HF GPT-2 under a
    recompute plan; measured in the c10 allocator's view, which a real cpu profile predicts."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from superneurons.bench.memory.meter import allocator_peak_bytes

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0, use_cache=use_cache,
    )  # fmt: skip
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "labels": ids}
    optimizer = torch.optim.AdamW(model.parameters())

    def step() -> None:
        model(**data).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def resident() -> list[torch.Tensor]:
        state = [t for s in optimizer.state.values() for t in s.values()]
        return [*model.parameters(), *model.buffers(), ids, *state]

    step()  # steady state: the optimizer's moments exist, as the plan predicts
    plan = plan_for_batch(  # the loop keeps only the loss
        model, data, budget_fraction=0.8, optimizer=optimizer, strategy="checkpoint",
        keep_outputs=False,
    )  # fmt: skip
    with apply_plan(model, plan):
        return plan.predicted_peak_bytes, allocator_peak_bytes(step, resident=resident)


@needs_hf
def test_hf_plan_peak_is_exact_with_and_without_kv_cache() -> None:
    # exact up to the stated margin for what the allocator serves outside any op
    predicted, measured = _hf_step_peak(use_cache=False)
    assert predicted - ALLOCATOR_MARGIN_BYTES <= measured <= predicted
    # HF's default use_cache=True: under a plan the cache is off in training (as HF's own
    # gradient checkpointing does), so recomputed blocks cannot append to it again
    predicted_cached, measured = _hf_step_peak(use_cache=True)
    assert predicted_cached == predicted
    assert predicted - ALLOCATOR_MARGIN_BYTES <= measured <= predicted


@needs_hf
def test_keep_outputs_plans_the_no_trainer_loop_within_budget() -> None:
    """HF's ``no_trainer`` loop keeps ``outputs`` (the logits) until the next step reassigns
    them: ``plan_for_batch(..., keep_outputs=True)`` counts them, and the loop stays within."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from superneurons.bench.memory.meter import allocator_peak_bytes

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0, use_cache=False,
    )  # fmt: skip
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "labels": ids}
    optimizer = torch.optim.AdamW(model.parameters())
    kept: dict[str, Any] = {}

    def step() -> None:
        outputs = model(**data)
        outputs.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        kept["outputs"] = outputs  # alive until the next step's outputs replace it

    def resident() -> list[torch.Tensor]:
        state = [t for s in optimizer.state.values() for t in s.values()]
        logits = [kept["outputs"].logits] if kept else []
        return [*model.parameters(), *model.buffers(), ids, *state, *logits]

    step()
    loss_only = plan_for_batch(
        model, data, budget_fraction=1.0, optimizer=optimizer, keep_outputs=False
    )
    eager = plan_for_batch(model, data, budget_fraction=1.0, optimizer=optimizer)  # the default
    assert eager.predicted_peak_bytes > loss_only.predicted_peak_bytes  # the logits count
    budget = eager.predicted_peak_bytes - 1  # a plan that must act
    plan = plan_for_batch(model, data, budget_bytes=budget, optimizer=optimizer, keep_outputs=True)
    with apply_plan(model, plan):
        measured = allocator_peak_bytes(step, resident=resident)
    assert measured <= budget
    assert plan.predicted_peak_bytes - ALLOCATOR_MARGIN_BYTES <= measured
