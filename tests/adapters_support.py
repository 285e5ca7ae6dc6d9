"""Shared by the adapter tests: a tiny HF Llama with LoRA (PEFT) or QLoRA (bitsandbytes nf4 on
the CPU) adapters, and the loop users write around it (``model(**batch).loss``, AdamW on the
adapters), with what is resident at a step's start for the allocator meter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from superneurons.memory.profiling.weights import weight_state_tensors

VOCAB, SEQ, BATCH = 2000, 64, 4
QV = ["q_proj", "v_proj"]
ALL_LINEAR = "all-linear"
IDS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    options = dict(
        hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
    )  # fmt: skip
    return LlamaConfig(**{**options, **overrides})


def lora(model: torch.nn.Module, targets: Any, task_type: str | None = "CAUSAL_LM") -> Any:
    """``model`` with LoRA r=8 adapters (dropout on: recompute must replay its masks): a
    ``PeftModelForCausalLM``, or PEFT's plain ``PeftModel`` with ``task_type=None``."""
    import peft

    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.1, task_type=task_type
    )
    return peft.get_peft_model(model, config).train()


def lora_llama(targets: Any = QV, task_type: str | None = "CAUSAL_LM", **overrides: Any) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return lora(LlamaForCausalLM(llama_config(**overrides)), targets, task_type)


def saved_llama(folder: Path) -> Path:
    """A tiny Llama saved where ``from_pretrained`` (and its quantization) can load it."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(llama_config()).save_pretrained(folder)
    return folder


def qlora_llama(folder: Path, targets: Any = QV) -> Any:
    """QLoRA: the saved Llama's linear layers in bitsandbytes nf4 with double quantisation
    (fp32 compute, on the CPU), LoRA adapters on top."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=quant, device_map="cpu", dtype=torch.float32
    )
    return lora(model, targets)


class Loop:
    """The user's loop: ``model(**batch).loss.backward()``, AdamW on what trains; with
    ``keep_outputs`` the ``outputs`` variable lives until the next step replaces it (HF's
    ``no_trainer`` examples)."""

    def __init__(self, model: torch.nn.Module, *, keep_outputs: bool = False) -> None:
        self.model = model
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=1e-3)
        self.batch = {"input_ids": IDS, "labels": IDS}
        self.keep_outputs = keep_outputs
        self.kept: Any = None
        self.count = 0
        self.losses: list[float] = []

    def step(self) -> None:
        torch.manual_seed(self.count)  # the same dropout masks as the eager twin's step
        self.count += 1
        outputs = self.model(**self.batch)
        loss = outputs.loss
        if self.keep_outputs:
            self.kept = outputs
        del outputs
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(float(loss.detach()))

    def resident(self) -> list[torch.Tensor]:
        state = [t for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t)]
        kept = [v for v in self.kept.values() if torch.is_tensor(v)] if self.kept else []
        weights = [*self.model.parameters(), *self.model.buffers()]
        return [*weights, *weight_state_tensors(self.model), *state, IDS, *kept]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))
