"""A set-up that fails leaves no trace: each set-up step made to raise on purpose (monkeypatched),
the model is exactly as before (parameters, buffers, gradients, each module's attributes,
instance-level ``forward``, hook dictionaries, HF's activation checkpointing flags and
``is_gradient_checkpointing``, ``use_cache``, ``requires_grad``), and so are the optimizer and,
for the Trainer callback, the trainer's arguments.

The model is a tiny Llama with LoRA adapters (PEFT), HF's activation checkpointing on and
``use_cache=True``, as TRL's ``SFTTrainer`` sets a model up: every flag set-up turns off is on.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from adapters_support import QV, Loop, lora_llama
from sentinel import assert_same, fingerprint
from superneurons.integrations.accelerate import prepare_superneurons
from superneurons.integrations.hf import plan_for_batch
from superneurons.memory import InfeasibleBudgetError, apply_plan

pytest.importorskip("peft")
pytest.importorskip("accelerate")


class Injected(RuntimeError):
    """The failure a test injects into one set-up step."""


def _raise(*_args: Any, **_kwargs: Any) -> Any:
    raise Injected("injected at a set-up step")


def _model() -> Any:
    model = lora_llama(QV)
    model.config.use_cache = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames these
        model.gradient_checkpointing_enable()
    model.enable_input_require_grads()  # as TRL does for PEFT under checkpointing
    return model


def _after_failing(call: Any, *models: torch.nn.Module, **extra: Any) -> list[dict[str, Any]]:
    """``call()``, which must raise :class:`Injected`; the traces of ``models`` taken while the
    failure is handled: its traceback still holds the set-up's frames (as a notebook's
    ``sys.last_traceback`` does), so nothing is restored by garbage collection behind it."""
    try:
        call()
    except Injected:
        return [_trace(model, **extra) for model in models]
    raise AssertionError("the injected failure did not propagate")


def _trace(model: torch.nn.Module, optimizer: Any = None, args: Any = None) -> dict[str, Any]:
    """Everything set-up could leave behind, as comparable data."""
    record = fingerprint(model, optimizer)
    record["forwards"] = {n: repr(vars(m).get("forward")) for n, m in model.named_modules()}
    record["hooks"] = {
        n: [list(getattr(m, h).items()) for h in ("_forward_hooks", "_forward_pre_hooks",
                                                  "_backward_hooks", "_backward_pre_hooks")]
        for n, m in model.named_modules()
    }  # fmt: skip
    record["flags"] = {n: vars(m).get("gradient_checkpointing") for n, m in model.named_modules()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        record["is_gradient_checkpointing"] = model.is_gradient_checkpointing
    record["use_cache"] = model.config.use_cache
    record["requires_grad"] = [p.requires_grad for p in model.parameters()]
    if args is not None:
        record["args"] = repr(sorted(vars(args).items()))
    return record


# Each set-up step of prepare_superneurons / plan_for_batch / apply_plan, made to raise.
STEPS = {
    "the profile": "superneurons.integrations.batch_step.BatchStep.profile",
    "inside the profiled step": "superneurons.memory.profiling.step._step",
    "below the largest layer": "superneurons.integrations.batch_step.BatchStep.below",
    "the planner": "superneurons.integrations.hf.make_plan",
    "use_cache off": "superneurons.integrations.accelerate.training_without_kv_cache",
    "apply_plan": "superneurons.integrations.accelerate.apply_plan",
    "inside apply_plan": "superneurons.memory.runtime.apply.guard_stateful_forwards",
}


@pytest.mark.parametrize("step", sorted(STEPS))
def test_prepare_superneurons_fails_without_a_trace(
    step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from accelerate import Accelerator

    loop = Loop(_model())
    loop.step()  # the optimizer holds state
    before = _trace(loop.model, loop.opt)
    assert before["is_gradient_checkpointing"] and before["use_cache"]
    monkeypatch.setattr(STEPS[step], _raise)
    after = _after_failing(
        lambda: prepare_superneurons(
            Accelerator(cpu=True), loop.model, sample_batch=loop.batch, optimizer=loop.opt,
            budget_fraction=0.5,  # below the plain step's floor: the head goes in chunks
        ),
        loop.model, optimizer=loop.opt,
    )  # fmt: skip
    assert_same(before, after[0])


def test_plan_for_batch_and_apply_plan_fail_without_a_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = Loop(_model())
    before = _trace(loop.model, loop.opt)
    with monkeypatch.context() as patch:
        patch.setattr(STEPS["below the largest layer"], _raise)
        after = _after_failing(
            lambda: plan_for_batch(
                loop.model, loop.batch, budget_fraction=0.5, optimizer=loop.opt
            ),
            loop.model, optimizer=loop.opt,
        )  # fmt: skip
    assert_same(before, after[0])
    model = lora_llama(QV)  # without HF checkpointing: apply_plan refuses units under it
    with pytest.raises(InfeasibleBudgetError) as info:
        plan_for_batch(model, loop.batch, budget_bytes=1)
    plan = plan_for_batch(model, loop.batch, budget_bytes=info.value.min_budget_bytes)
    assert plan.head is not None and plan.count("recompute") > 0
    before = _trace(model)
    monkeypatch.setattr(STEPS["inside apply_plan"], _raise)
    assert_same(before, _after_failing(lambda: apply_plan(model, plan), model)[0])


TRAINER_STEPS = {
    "the sample batch": "superneurons.integrations.transformers._first_batch",
    "prepare_superneurons": "superneurons.integrations.accelerate.apply_plan",
    "after set-up": "superneurons.integrations.transformers.SuperNeuronsCallback._resume",
}


@pytest.mark.parametrize("step", sorted(TRAINER_STEPS))
def test_the_trainer_callback_fails_without_a_trace(
    step: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from superneurons.integrations.transformers import SuperNeuronsCallback

    model = lora_llama(QV)
    model.config.use_cache = True
    rows = [{"input_ids": x, "labels": x} for x in Loop(model).batch["input_ids"]]
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, max_steps=1,
        save_strategy="no", report_to=[], disable_tqdm=True, gradient_checkpointing=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    seen: list[dict[str, Any]] = []

    class _Before(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            state.global_step = 1 if step == "after set-up" else 0  # a resumed run
            seen.append(_trace(model, trainer.optimizer, args))

    trainer.add_callback(_Before())
    callback = SuperNeuronsCallback(trainer, budget_fraction=0.5)
    trainer.add_callback(callback)
    monkeypatch.setattr(TRAINER_STEPS[step], _raise)
    try:
        trainer.train()
    except Injected:
        after = _trace(model, trainer.optimizer, trainer.args)  # the traceback alive
    assert seen[0]["is_gradient_checkpointing"]  # Trainer has set use_cache=False itself
    assert_same(seen[0], after)
    assert callback.setup is None
