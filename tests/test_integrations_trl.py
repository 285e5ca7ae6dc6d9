"""TRL's SFTTrainer (and HF's Trainer) with SuperNeuronsCallback: planning leaves the run exactly
as it was, the profile runs the forward the trainer calls, resume reads the checkpoint it is
given, and on 1 and 2 gloo ranks training under a 0.6 budget is bit-identical to training
without the callback, within the budget (packing x bf16: each value of each knob once on 1 rank,
the other two configurations on 2 ranks: the whole matrix once, each knob with and without DDP)."""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import trl_run
from integrations_support import TinyLM, batch
from sentinel import assert_same, training_state
from superneurons.errors import ConfigError
from superneurons.integrations.hf import plan_for_batch

needs_trl = pytest.mark.skipif(
    importlib.util.find_spec("trl") is None, reason="trl not installed (pip install .[trl])"
)


def _sentinel_run(trainer: Any, callback: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train once (the optimizer then holds state), then again with the callback between two
    fingerprints taken at on_train_begin."""
    from transformers import TrainerCallback

    trainer.train()
    seen: list[dict[str, Any]] = []

    class _Fingerprint(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            seen.append(training_state(trainer.model, trainer.optimizer, trainer.lr_scheduler))

    trainer.args.max_steps = 1
    trainer.add_callback(_Fingerprint())
    trainer.add_callback(callback)
    trainer.add_callback(_Fingerprint())
    trainer.train()
    assert callback.setup.plan is not None and callback.setup.plan.count("recompute") > 0
    return seen[0], seen[1]


@needs_trl
def test_trl_planning_leaves_the_run_as_it_was(tmp_path: Path) -> None:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    import trl_support
    from superneurons.integrations.transformers import SuperNeuronsCallback

    tok = trl_support.tokenizer()
    args = SFTConfig(
        output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, max_steps=2,
        save_strategy="no", report_to=[], disable_tqdm=True, seed=0, bf16=True,
        max_length=trl_support.SEQ_CHARS + 4,
    )  # fmt: skip
    data = Dataset.from_dict({"text": trl_support.texts(16)})
    trainer = SFTTrainer(
        model=trl_support.model(len(tok)), args=args, train_dataset=data, processing_class=tok
    )
    callback = SuperNeuronsCallback(trainer, budget_fraction=0.6)
    before, after = _sentinel_run(trainer, callback)
    assert before["optimizer"]["state"]  # there was state to keep
    assert_same(before, after)


@needs_trl
def test_hf_trainer_planning_leaves_the_run_as_it_was(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from superneurons.integrations.transformers import SuperNeuronsCallback

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    ids = torch.randint(0, 64, (16, 32), generator=torch.Generator().manual_seed(1))
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, max_steps=2,
        save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=[{"input_ids": x, "labels": x} for x in ids],
    )
    callback = SuperNeuronsCallback(trainer, budget_fraction=0.8, strategy="checkpoint")
    before, after = _sentinel_run(trainer, callback)
    assert before["optimizer"]["state"]
    assert_same(before, after)


@needs_trl
def test_trl_profiles_the_fused_forward_it_trains_with(tmp_path: Path) -> None:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    import trl_support
    from superneurons.integrations.transformers import _fused_lm_head_loss, _loss_of

    tok = trl_support.tokenizer()
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False)
    data = Dataset.from_dict({"text": trl_support.texts(8)})
    trainer = SFTTrainer(
        model=trl_support.model(len(tok)), args=args, train_dataset=data, processing_class=tok
    )
    assert _loss_of(trainer) is _fused_lm_head_loss
    ids = torch.tensor([tok(t)["input_ids"] for t in trl_support.texts(4)])
    data_batch = {"input_ids": ids, "labels": ids}
    fused = plan_for_batch(
        trainer.model, data_batch, budget_fraction=1.0, loss_of=_loss_of(trainer)
    )
    logits = plan_for_batch(trainer.model, data_batch, budget_fraction=1.0)
    # the fused head never holds the (tokens, vocab) logits through backward
    assert fused.predicted_peak_bytes != logits.predicted_peak_bytes


def test_a_forward_that_runs_another_module_is_named_as_the_cause() -> None:
    model, other = TinyLM(), TinyLM()
    model.forward = other.forward  # type: ignore[method-assign]
    with pytest.raises(ConfigError, match="no units were observed"):
        plan_for_batch(model, batch(0), budget_fraction=0.6)


def test_resume_reads_the_folder_train_was_given(tmp_path: Path) -> None:
    from superneurons.integrations.transformers import _resumed_from

    class _Trainer:
        def _inner_training_loop(self, resume_from_checkpoint: str | None = None) -> Any:
            return _resumed_from(self)

    trainer = _Trainer()
    assert trainer._inner_training_loop(str(tmp_path / "ckpt-7")) == tmp_path / "ckpt-7"
    assert trainer._inner_training_loop(None) is None
    assert _resumed_from(types.SimpleNamespace()) is None  # not inside train(): no folder


def _check_adapters(eager: dict[str, Any], planned: dict[str, Any], name: str) -> None:
    """A LoRA run under a plan is TRL's alone: losses and adapters equal, within 1e-6 relative
    (TRL's kernel runs per chunk of tokens: the GEMMs see fewer rows), and within the budget."""
    assert planned["head"] == "base_model.model.lm_head", name  # below TRL's fused head
    for got, expected in zip(planned["losses"], eager["losses"], strict=True):
        assert abs(got - expected) <= 1e-6 * abs(expected), name
    for key, expected in eager["adapters"].items():
        error = torch.tensor(planned["adapters"][key]) - torch.tensor(expected)
        assert float(error.norm()) <= 1e-6 * float(torch.tensor(expected).norm()), (name, key)
    assert max(planned["measured_peak_bytes"]) <= planned["budget_bytes"], name


@needs_trl
def test_sft_trainer_with_lora_under_a_budget_is_trl_alone(tmp_path: Path) -> None:
    """``SFTTrainer(peft_config=LoraConfig(...))`` with the callback at 0.6: TRL's fused head
    binds the peak, so the plan runs it in chunks of tokens, through PEFT's wrappers."""
    pytest.importorskip("peft")
    import trl_support

    options: dict[str, Any] = dict(packing=False, bf16=False, peft=True, examples=32)
    eager = trl_support.run(tmp_path / "eager", **options)
    planned = trl_support.run(tmp_path / "planned", budget_fraction=0.6, meter=True, **options)
    _check_adapters(eager, planned, "1 rank")


def _check_matrix(ranks: list[dict[str, Any]], matrix: tuple[tuple[bool, bool], ...]) -> None:
    for record in ranks:
        for packing, bf16 in matrix:
            name = f"packing={packing},bf16={bf16}"
            eager, planned = record[f"{name},eager"], record[f"{name},planned"]
            assert set(planned["plan"].values()) <= {"keep", "recompute"}, name
            assert "recompute" in planned["plan"].values(), name
            # recompute: the same arithmetic, so the same numbers to the bit
            assert planned["losses"] == eager["losses"], name
            assert planned["params"] == eager["params"], name
            assert max(planned["measured_peak_bytes"]) <= planned["budget_bytes"], name
    for key in ranks[0]:
        assert ranks[0][key]["params"] == ranks[-1][key]["params"], key  # equal on every rank


@pytest.mark.slow
@needs_trl
def test_sft_trainer_under_a_budget_is_bit_identical_on_one_rank(tmp_path: Path) -> None:
    record = json.loads(json.dumps(trl_run.records(tmp_path)))  # as a rank writes it
    _check_matrix([record], trl_run.ONE_RANK)
    for name, planned in record.items():
        if name.endswith(",planned"):  # fp32 and bf16 (accelerate's autocast) alike
            steady = max(planned["measured_peak_bytes"][1:])  # step 1 makes the AdamW state
            assert abs(planned["predicted_peak_bytes"] - steady) <= 0.01 * steady, name


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("two-rank-runs")
@needs_trl
def test_sft_trainer_on_two_gloo_ranks(two_rank_runs: Any) -> None:
    ranks = two_rank_runs.part("trl")
    planned = [{k: v for k, v in r.items() if "packing" in k} for r in ranks]
    _check_matrix(planned, trl_run.TWO_RANKS)
    for record in ranks:
        assert record["saved"] == [f"superneurons-compression-rank{r}.pt" for r in (0, 1)]
        # resumed from b/checkpoint-2 into output_dir c: the state came from b
        assert record["resumed_elsewhere"]["params"] == record["compressed"]["params"]
        assert record["resumed_elsewhere"]["losses"] == record["compressed"]["losses"]
        assert "differs between rank 0 and rank 1" in record["nudged"]
    assert ranks[0]["compressed"]["params"] == ranks[1]["compressed"]["params"]
    assert ranks[0]["nudged"] == ranks[1]["nudged"]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("two-rank-runs")
@needs_trl
def test_sft_trainer_with_lora_on_two_gloo_ranks(two_rank_runs: Any) -> None:
    pytest.importorskip("peft")
    ranks = two_rank_runs.part("trl-peft")
    for rank, record in enumerate(ranks):
        _check_adapters(record["peft,eager"], record["peft,planned"], f"rank {rank}")
    assert ranks[0]["peft,planned"]["params"] == ranks[1]["peft,planned"]["params"]
