"""The demo's language-model part: what fits, and a fine-tune under a budget.

(a) :func:`what_fits`: ``superneurons plan --model hf:NAME --dtype bf16`` for shipped causal-LM
    configurations (:mod:`superneurons.models.hf_configs`), on fake tensors (no weights, no
    device): HF gradient checkpointing's modelled peak (every block recomputed: the
    ``checkpoint`` strategy's floor) and superneurons' floor, each against a 24 GiB and an
    80 GiB card: a full fine-tune, LoRA and QLoRA (``plan --lora/--quantize``), AdamW, batch 1.
    Each floor is extrapolated in depth from 4- and 8-layer copies of the configuration, as
    ``plan --fit-depth`` does (:mod:`superneurons.memory.sizing.depth_fit`: a strategy's floor
    is affine in the depth of a stack of identical decoder layers), so a 32-layer model costs
    the fake ops of 12 layers. Eager's peak is not in the table: it is the larger of two such
    lines (the head's working set or the saved activations bind), which two probes cannot
    tell apart.
(b) :func:`trl_under_budget`: a tiny Llama trained for a few steps by TRL's ``SFTTrainer``
    twice from the same weights and data: with TRL's own gradient checkpointing (its default),
    and with :class:`~superneurons.integrations.transformers.SuperNeuronsCallback` under a
    budget; each step's peak of live storage bytes is measured, and the losses compared.
"""

from __future__ import annotations

import functools
import logging
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from superneurons.bench.memory.trainer_meter import TrainerStepPeaks
from superneurons.data.chars import char_tokenizer, word_texts

__all__ = ["CARDS_GIB", "TUNINGS", "language_model_part", "trl_under_budget", "what_fits"]

log = logging.getLogger("superneurons.demo")

GIB = 2**30
CARDS_GIB = (24, 80)  # a 24 GiB card (RTX 4090 class) and an 80 GiB one (H100/A100-80GB)
Progress = Callable[[str], None]


# How each row fine-tunes: a full fine-tune, LoRA (QLoRA's recipe: r 16 on every linear layer)
# and QLoRA (the same adapters over nf4 base weights, double quantisation); ``plan``'s flags.
TUNINGS: dict[str, tuple[str | None, str | None]] = {
    "full": (None, None),
    "lora": ("r=16,alpha=32,targets=all-linear", None),
    "qlora": ("r=16,alpha=32,targets=all-linear", "nf4,double_quant=true"),
}


def what_fits(
    names: tuple[str, ...], *, seq_len: int, tunings: tuple[str, ...] = ("full",)
) -> list[dict[str, Any]]:
    """One row per shipped configuration and tuning (:data:`TUNINGS`): modelled peaks (bytes)
    of HF gradient checkpointing and superneurons' floor, and which fit each card of
    :data:`CARDS_GIB`."""
    from superneurons.memory.sizing.llm import load_config

    rows = []
    for name in names:
        config, source = load_config(name)
        for tuning in tunings:
            rows.append(_fits_row(name, config, source, seq_len=seq_len, tuning=tuning))
    return rows


def _fits_row(name: str, config: Any, source: str, *, seq_len: int, tuning: str) -> dict:
    from superneurons.memory.sizing.adapters import parse_lora, parse_quantize
    from superneurons.memory.sizing.depth_fit import PROBE_LAYERS, extrapolated, num_layers
    from superneurons.memory.sizing.llm import LMStep, max_positions

    lora, quantize = TUNINGS[tuning]
    limit = max_positions(config)
    step = LMStep(
        seq_len=min(seq_len, limit or seq_len),
        dtype="bf16",
        lora=None if lora is None else parse_lora(lora),
        quantize=None if quantize is None else parse_quantize(quantize),
    )
    peaks_at = functools.partial(_peaks_at, name, config, source, step)
    found = extrapolated(peaks_at, num_layers(config))
    floor_strategy = min(found, key=lambda strategy: found[strategy])
    peaks = {
        "hf_checkpointing_bytes": found["checkpoint"],
        "superneurons_bytes": found[floor_strategy],
    }
    flags = "".join(
        f" --{flag} {value}" for flag, value in (("lora", lora), ("quantize", quantize)) if value
    )
    row: dict[str, Any] = {
        "model": f"hf:{name}",
        "tuning": tuning,
        "seq_len": step.seq_len,
        "command": f"superneurons plan --model hf:{name} --seq-len {step.seq_len} --dtype bf16"
        + flags,
        **peaks,
        "superneurons_strategy": floor_strategy,
        "depth_fit_layers": list(PROBE_LAYERS),
    }
    for card in CARDS_GIB:
        for key, value in peaks.items():
            row[f"{key.removesuffix('_bytes')}_fits_{card}gib"] = value <= card * GIB
    return row


def _peaks_at(name: str, config: Any, source: str, step: Any, layers: int) -> dict[str, int]:
    """Every strategy's floor of ``config`` cut to ``layers`` decoder layers (fake tensors, the
    h100 preset's cost model)."""
    from superneurons.memory.planner.cost import cost_model
    from superneurons.memory.sizing.depth_fit import with_layers
    from superneurons.memory.sizing.model_plan import plan_model
    from superneurons.memory.sizing.target import LMTarget

    result = plan_model(
        LMTarget(name, with_layers(config, layers), source, step),
        budget_bytes=max(CARDS_GIB) * GIB,
        cost=cost_model("h100"),
    )
    return {strategy: f.min_budget_bytes for strategy, f in result.floors.items()}


# The tiny Llama of part (b): a Llama-2-sized vocabulary (its character tokenizer uses the
# first few ids) over a narrow backbone, batch x tokens as a short fine-tuning batch: as in
# real fine-tunes of 32k-128k vocabularies, the LM head's logits outweigh a block's activations.
TINY_VOCAB = 32000
TINY_SEQ_TOKENS = 256
TINY_BATCH = 4


def _texts(count: int = 200, chars: int = TINY_SEQ_TOKENS - 4) -> list[str]:
    return word_texts(count, chars=chars, words_per_text=chars // 3)


def _tiny_llama() -> Any:
    from transformers.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=TINY_SEQ_TOKENS + 8,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _sft_run(steps: int, *, budget_fraction: float | None) -> dict[str, Any]:
    """One SFTTrainer run on the CPU: TRL alone (its default gradient checkpointing), or with
    the callback planning under ``budget_fraction`` of the eager peak (the callback turns TRL's
    checkpointing off and plans instead)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from superneurons.integrations.transformers import SuperNeuronsCallback

    tok = char_tokenizer()
    with tempfile.TemporaryDirectory(prefix="sn-demo-trl-") as out:
        args = SFTConfig(
            output_dir=out, use_cpu=True, per_device_train_batch_size=TINY_BATCH,
            max_steps=steps, learning_rate=3e-3, logging_steps=1, save_strategy="no",
            report_to=[], disable_tqdm=True, seed=0, max_length=TINY_SEQ_TOKENS,
            dataset_num_proc=None,
        )  # fmt: skip
        trainer = SFTTrainer(
            model=_tiny_llama(),
            args=args,
            train_dataset=Dataset.from_dict({"text": _texts()}),
            processing_class=tok,
        )
        callback = None
        if budget_fraction is not None:
            callback = SuperNeuronsCallback(trainer, budget_fraction=budget_fraction)
            trainer.add_callback(callback)
        meter = TrainerStepPeaks(trainer, record_timeline=True)
        trainer.add_callback(meter.callback)
        trainer.train()
    record: dict[str, Any] = {
        "losses": [row["loss"] for row in trainer.state.log_history if "loss" in row],
        "peak_bytes": max(meter.peaks),
        "step_peaks_bytes": meter.peaks,
        "timeline_bytes": meter.timeline_bytes,
    }
    if callback is not None and callback.setup is not None and callback.setup.plan is not None:
        plan = callback.setup.plan
        record.update(
            budget_bytes=plan.budget_bytes,
            predicted_peak_bytes=plan.predicted_peak_bytes,
            strategy=plan.strategy,
            actions={a: plan.count(a) for a in ("keep", "recompute", "offload")},
        )
    return record


def trl_under_budget(steps: int, *, budget_fraction: float) -> dict[str, Any]:
    """TRL's gradient checkpointing, then the callback under ``budget_fraction`` of the eager
    peak (raised by 0.1 while the planner refuses it, each refusal recorded): both runs, the
    peak ratio and whether the losses are identical."""
    from superneurons.memory.plan import InfeasibleBudgetError

    torch.set_num_threads(1)
    trl = _sft_run(steps, budget_fraction=None)
    refused: list[dict[str, Any]] = []
    while True:
        try:
            ours = _sft_run(steps, budget_fraction=budget_fraction)
            break
        except InfeasibleBudgetError as exc:
            if budget_fraction >= 1.0:
                raise
            refused.append({"budget_fraction": budget_fraction, "message": str(exc)})
            budget_fraction = min(1.0, round(budget_fraction + 0.1, 2))
    pairs = list(zip(trl["losses"], ours["losses"], strict=True))
    return {
        "model": (
            f"tiny LlamaForCausalLM (4 blocks, width 64, MLP 256, vocabulary {TINY_VOCAB}), "
            f"batch {TINY_BATCH} x {TINY_SEQ_TOKENS} tokens, TRL's default bf16 autocast"
        ),
        "steps": steps,
        "budget_fraction": budget_fraction,
        "refused": refused,
        "trl_checkpointing": trl,
        "superneurons": ours,
        "peak_over_trl": ours["peak_bytes"] / trl["peak_bytes"],
        "within_budget": ours["peak_bytes"] <= ours.get("budget_bytes", 0),
        "losses_identical": ours["losses"] == trl["losses"],
        "first_loss_identical": pairs[0][0] == pairs[0][1],
        "loss_max_rel_diff": max(abs(a - b) / max(abs(a), 1e-30) for a, b in pairs),
    }


def language_model_part(config: Any, *, progress: Progress) -> dict[str, Any]:
    """Both parts for a :class:`~superneurons.demo.run.DemoConfig`."""
    from superneurons.demo.report import losses_phrase

    fits = what_fits(config.lm_models, seq_len=config.lm_seq_len, tunings=config.lm_tunings)
    for row in fits:
        progress(
            f"      {row['model']} ({row['tuning']}) at {row['seq_len']} tokens: HF checkpointing "
            f"{row['hf_checkpointing_bytes'] / GIB:.1f} GiB, superneurons "
            f"{row['superneurons_bytes'] / GIB:.1f} GiB"
        )
    trl = trl_under_budget(config.lm_steps, budget_fraction=config.lm_budget_fraction)
    progress(
        f"      TRL SFTTrainer: peak {trl['superneurons']['peak_bytes'] / 2**20:.1f} MiB under "
        f"the callback vs {trl['trl_checkpointing']['peak_bytes'] / 2**20:.1f} MiB with TRL's "
        f"checkpointing; losses {losses_phrase(trl)}"
    )
    return {"what_fits": fits, "cards_gib": list(CARDS_GIB), "trl": trl}
