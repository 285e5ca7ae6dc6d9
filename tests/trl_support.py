"""TRL's SFTTrainer on a tiny Llama built from a config, with a character tokenizer
(``superneurons.data.chars``, no downloads): one training run per configuration, with or
without SuperNeuronsCallback, and what it leaves (losses, a hash of the final parameters, the
plan, each step's measured peak).

Used in-process by test_integrations_trl and test_integrations_host_step (one rank), and by
trl_run.py, host_step_run.py and two_rank_runs.py under torchrun (two).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import torch

from superneurons.bench.memory.trainer_meter import TrainerStepPeaks
from superneurons.data.chars import char_tokenizer, word_texts

SEQ_CHARS = 30  # every text has this many characters: every unpacked batch has one shape
STEPS = 3
BATCH = 8


def tokenizer() -> Any:
    return char_tokenizer()


def texts(count: int = 400) -> list[str]:
    return word_texts(count, chars=SEQ_CHARS, words_per_text=12)


# the tiny Llama of benchmarks/below_largest_layer.py (hidden 256, 4 layers, 4/2 heads, MLP 688,
# vocabulary 32000): what use_full_model() switches model() to
FULL = {
    "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000,
}  # fmt: skip
_full = False


def use_full_model() -> None:
    """From now on :func:`model` builds the :data:`FULL` Llama (benchmarks, check scripts)."""
    global _full
    _full = True


def model(vocab_size: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if _full:
        config = LlamaConfig(
            **FULL, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=2
        )
        return LlamaForCausalLM(config)
    # NOTE: narrow and deep-MLP on purpose. TRL's fused LM head computes log-probabilities in
    # tiles of (min(tokens, 4096), 32768) logits whatever the vocabulary
    # (trl/kernels/chunked_logprob.py, ``mm_buf``): 128 KiB per token in fp32, a peak no plan
    # of the blocks can lower. Activations must outweigh it for a 0.6 budget to be reachable:
    # with 4 blocks of width 16 and MLP 4096 the smallest plan is 0.44 of the eager peak in
    # fp32 and 0.55 in bf16 at batch 4 x 31 tokens, 0.28 in fp32 at batch 8 (a wider,
    # shallower MLP keeps the head's buffer dominant: 0.92 at width 64, MLP 128, batch 4).
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=4096, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def adapter_model() -> Any:
    """A tiny Llama whose LM head matters (vocabulary 4000, hidden 64): TRL's fused head holds
    (tokens, vocabulary) tiles, so a 0.6 budget needs the head in chunks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4000, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def lora_config() -> Any:
    """LoRA r=8 on q,v with dropout (recompute must replay its masks)."""
    from peft import LoraConfig

    return LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.1,
        task_type="CAUSAL_LM",
    )  # fmt: skip


def params_sha256(module: torch.nn.Module) -> str:
    sha = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        sha.update(name.encode() + data)
    return sha.hexdigest()


def optimizer_state_sha256(trainer: Any, callback: Any) -> str:
    """A digest of the optimizer's state (moments and step counters by parameter index): the
    trainer's own, or the host optimizer's where the plan steps it on the host (whose indices
    follow the trainer optimizer's parameter groups)."""
    from superneurons.memory.offload.handover import inner_optimizer

    host = callback.setup.host_optimizer if callback and callback.setup else None
    if host is not None:
        state = host.state_dict()["optimizer"]["state"]
    else:
        state = inner_optimizer(trainer.optimizer).state_dict()["state"]
    sha = hashlib.sha256()
    for index in sorted(state):
        for key in sorted(state[index]):
            value = state[index][key]
            data = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            sha.update(f"{index}.{key}".encode() + data)
    return sha.hexdigest()


def run(
    out: Path,
    *,
    packing: bool,
    bf16: bool,
    budget_fraction: float | None = None,
    strategy: str = "auto",
    compression: str | None = None,
    meter: bool = False,
    save_steps: int | None = None,
    stop_at: int | None = None,
    resume: Path | None = None,
    checks: list[Any] | None = None,
    peft: bool = False,
    examples: int = 400,
    sft: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One SFTTrainer run of ``STEPS`` steps; with a budget and/or compression, the callback;
    with ``peft``, LoRA adapters (``peft_config``) on :func:`adapter_model`. ``sft``: further
    ``SFTConfig`` options (they override the ones set here)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from superneurons.integrations.transformers import SuperNeuronsCallback

    logging.getLogger("superneurons").setLevel(logging.INFO)
    tok = tokenizer()
    options: dict[str, Any] = dict(
        output_dir=str(out),
        use_cpu=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        bf16=bf16,
        packing=packing,
        max_length=2 * SEQ_CHARS + 4 if packing else SEQ_CHARS + 4,
        dataset_num_proc=None,
    )
    # NOTE: TRL's default gradient_checkpointing=True stays: the callback takes it over
    args = SFTConfig(**{**options, **(sft or {})})
    net = adapter_model() if peft else model(len(tok))
    trainer = SFTTrainer(
        model=net,
        args=args,
        train_dataset=Dataset.from_dict({"text": texts(examples)}),
        processing_class=tok,
        peft_config=lora_config() if peft else None,
    )
    callback = None
    if budget_fraction is not None or compression is not None:
        callback = SuperNeuronsCallback(
            trainer, budget_fraction=budget_fraction, compression=compression, strategy=strategy
        )
        for check in checks or []:
            trainer.add_callback(check)  # before ours: runs first at on_train_begin
        trainer.add_callback(callback)
    peak = TrainerStepPeaks(trainer) if meter else None
    if peak is not None:
        trainer.add_callback(peak.callback)
    if stop_at is not None:

        class _Stop(TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if state.global_step == stop_at:
                    control.should_training_stop = True

        trainer.add_callback(_Stop())
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    record: dict[str, Any] = {"losses": losses, "params": params_sha256(net)}
    if peft:  # the adapters' values, for a comparison within a tolerance
        record["adapters"] = {
            n: p.detach().reshape(-1).tolist() for n, p in net.named_parameters() if "lora_" in n
        }
    record["grad_norms"] = [
        row["grad_norm"] for row in trainer.state.log_history if "grad_norm" in row
    ]
    record["optimizer_state"] = optimizer_state_sha256(trainer, callback)
    runtime = [row["train_runtime"] for row in trainer.state.log_history if "train_runtime" in row]
    record["train_runtime_s"] = runtime[-1] if runtime else None
    if callback is not None and callback.setup is not None and callback.setup.plan is not None:
        plan = callback.setup.plan
        record["plan"] = {u.fqn: u.action for u in plan.units}
        record["head"] = plan.head.fqn if plan.head is not None else None
        reserved = callback.setup.reserved_bytes  # DDP's buckets, outside the plan's budget
        record["budget_bytes"] = plan.budget_bytes + reserved
        record["predicted_peak_bytes"] = plan.predicted_peak_bytes + reserved
        record["host_optimizer"] = plan.host_optimizer
    ddp = isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    # DDP's buckets exist before any step, so the meter cannot see them: one copy of the
    # gradients, added to what it measures
    trainable = [p for p in net.parameters() if p.requires_grad]
    record["bucket_bytes"] = sum(p.numel() * p.element_size() for p in trainable) if ddp else 0
    if peak is not None:
        record["measured_peak_bytes"] = [p + record["bucket_bytes"] for p in peak.peaks]
    return record
