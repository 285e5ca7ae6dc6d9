"""The loop's own optimizer handed over to the host optimizer: built like it, following its
scheduler, stepping bitwise as the loop would, its state saved and resumed; and where the
integrations use it without manual steps (Accelerate, the planner's refusal under DDP)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from integrations_support import TinyLM, batch
from superneurons.errors import ConfigError
from superneurons.integrations.accelerate import prepare_superneurons
from superneurons.integrations.hf import plan_for_batch
from superneurons.memory.offload.handover import factory_like

HOST = "offload+host-optimizer"
needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="no accelerate"
)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW with two groups (no decay on biases), fused: the host optimizer's kernel."""
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    rest = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2, fused=True)


def _run(
    steps: range, *, host: bool, resume: dict[str, Any] | None = None
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Accelerate's ordinary loop (with an LR schedule) for ``steps``; with ``host``, after
    ``prepare_superneurons`` planned the host optimizer."""
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = TinyLM()
    optimizer = _optimizer(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    setup = None
    if resume is not None:  # what the loop saves of its own, loaded as Trainer does
        model.load_state_dict(resume["model"])
        scheduler.load_state_dict(resume["scheduler"])
        optimizer.load_state_dict(resume["optimizer"])  # host: hyperparameters, no state
    if host:
        setup = prepare_superneurons(
            accelerator, model, sample_batch=batch(1), budget_fraction=1.0,
            optimizer=optimizer, strategy=HOST,
        )  # fmt: skip
        assert setup.plan is not None and setup.plan.host_optimizer
        if resume is not None:
            setup.load_state_dict(resume["setup"])
    for step in steps:
        torch.manual_seed(10 + step)  # dropout
        optimizer.zero_grad()
        accelerator.backward(model(**batch(100 + step))["loss"])
        if host:  # every gradient left the device during backward
            assert all(p.grad is None for p in model.parameters())
        optimizer.step()
        scheduler.step()
    saved = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "scheduler": scheduler.state_dict(),
        "optimizer": optimizer.state_dict(),
        "setup": setup.state_dict() if setup is not None else None,
    }
    if setup is not None:
        assert not optimizer.optimizer.state  # the loop's optimizer holds no state
        setup.remove()
    return [p.detach().clone() for p in model.parameters()], saved


@needs_accelerate
def test_accelerate_loop_steps_on_the_host_bitwise_and_resumes() -> None:
    reference, _ = _run(range(4), host=False)
    _, half = _run(range(2), host=True)
    assert half["setup"]["host_optimizer"]["masters"]  # fp32 masters and moments saved
    resumed, _ = _run(range(2, 4), host=True, resume=half)
    # the same fused AdamW per parameter, the schedule followed, the state resumed
    for a, b in zip(reference, resumed, strict=True):
        assert torch.equal(a, b)


def test_factory_like_keeps_groups_and_hyperparameters() -> None:
    model = TinyLM()
    loop = _optimizer(model)
    masters = [p.detach().float().clone() for p in model.parameters()]
    built = factory_like(loop, model)(masters)
    assert type(built) is torch.optim.AdamW
    assert [len(g["params"]) for g in built.param_groups] == [
        len(g["params"]) for g in loop.param_groups
    ]
    assert [g["weight_decay"] for g in built.param_groups] == [0.1, 0.0]
    assert built.param_groups[1]["params"][0] is masters[[
        i for i, (n, _) in enumerate(model.named_parameters()) if n.endswith("bias")
    ][0]]  # fmt: skip
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ConfigError, match="not trainable parameters"):
        factory_like(other, model)


def test_host_optimizer_only_where_it_can_be_applied() -> None:
    model = TinyLM()
    # the loop's model already wrapped in DDP: never chosen, refused when asked for
    with pytest.raises(ConfigError, match="allow_host_optimizer"):
        plan_for_batch(
            model, batch(0), budget_fraction=1.0, strategy=HOST, allow_host_optimizer=False
        )
    plan = plan_for_batch(model, batch(0), budget_fraction=1.0, strategy=HOST)
    assert plan.host_optimizer
    # bucket fqns relative to the model, as apply_plan resolves them
    names = {n for n, _ in model.named_parameters()}
    assert plan.grad_buckets and {f for b in plan.grad_buckets for f in b} <= names
    with pytest.raises(ConfigError, match="pass optimizer="):
        prepare_superneurons(
            _SingleProcess(), model, sample_batch=batch(0), budget_fraction=1.0, strategy=HOST
        )


class _SingleProcess:
    distributed_type = "NO"
    num_processes = 1
    gradient_accumulation_steps = 1


class _StopAt:
    """A TrainerCallback (duck-typed) that stops training after ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def __getattr__(self, name: str) -> Any:  # every other event: nothing
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


def _trainer(out: Any, *, host: bool, stop: int | None = None, resume: Any = None) -> Any:
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
        output_dir=str(out), use_cpu=True, per_device_train_batch_size=4, max_steps=4,
        learning_rate=3e-3, optim="adamw_torch_fused", max_grad_norm=0.0,
        save_strategy="steps" if stop else "no", save_steps=stop or 1, report_to=[],
        disable_tqdm=True, seed=0,
    )  # fmt: skip
    data = [{"input_ids": x, "labels": x} for x in ids]
    trainer = Trainer(model=model, args=args, train_dataset=data)
    callback = None
    if host:
        callback = SuperNeuronsCallback(trainer, budget_fraction=1.0, strategy=HOST)
        trainer.add_callback(callback)
    if stop:
        trainer.add_callback(_StopAt(stop))
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return [p.detach().clone() for p in model.parameters()], callback


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="no transformers")
def test_trainer_steps_on_the_host_and_resumes_bitwise(tmp_path: Any) -> None:
    reference, _ = _trainer(tmp_path / "plain", host=False)
    _, callback = _trainer(tmp_path / "host", host=True, stop=2)
    assert callback.setup.plan.host_optimizer
    checkpoint = tmp_path / "host" / "checkpoint-2"
    assert (checkpoint / "superneurons-host-optimizer-rank0.pt").is_file()
    resumed, _ = _trainer(tmp_path / "host", host=True, resume=checkpoint)
    for a, b in zip(reference, resumed, strict=True):
        assert torch.equal(a, b)
