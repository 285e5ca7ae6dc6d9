"""A character-level GPT in the style of nanoGPT (Karpathy), itself GPT-2 (Radford et al., 2019):
pre-LayerNorm transformer blocks, causal self-attention via ``scaled_dot_product_attention``,
tied input/output embeddings, GPT-2 initialisation (residual projections scaled by
``1/sqrt(2 * n_layer)``).

Each :class:`Block` is a module inside ``transformer.h`` (an ``nn.ModuleList``) so a memory
planner can treat blocks as checkpointable units. The ``"gpt2"`` preset (124M parameters,
T = 1024, vocabulary 50257) is for memory planning; the defaults train on a CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from superneurons.errors import ConfigError

__all__ = ["GPT", "GPTConfig", "PRESETS", "gpt"]


@dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of :class:`GPT` (defaults: a ~0.8M-parameter char model)."""

    vocab_size: int = 128
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ConfigError(f"gpt: {name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"gpt: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"gpt: dropout must be in [0, 1), got {self.dropout}")


PRESETS: dict[str, dict[str, int]] = {
    # GPT-2 small (Radford et al., 2019): 124M parameters.
    "gpt2": {"vocab_size": 50257, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768},
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``forward(idx: (B, T) int64) -> logits (B, T, vocab_size)``; with ``targets`` ((B, T)
    int64, aligned with ``idx``'s positions, -100 ignored) it returns the mean cross-entropy
    instead, which a plan may compute in chunks without the logits
    (:mod:`superneurons.memory.chunked.lmhead`)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "wpe": nn.Embedding(config.block_size, config.n_embd),
                "drop": nn.Dropout(config.dropout),
                "h": nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                "ln_f": nn.LayerNorm(config.n_embd, bias=config.bias),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer["wte"].weight = self.lm_head.weight  # weight tying (GPT-2)
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        _, T = idx.shape
        if self.config.block_size < T:
            raise ConfigError(
                f"gpt: sequence length {T} exceeds block_size {self.config.block_size}"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.transformer["drop"](self.transformer["wte"](idx) + self.transformer["wpe"](pos))
        for block in cast(nn.ModuleList, self.transformer["h"]):
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.transformer["ln_f"](x))  # (B, T, vocab_size)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def gpt(
    *,
    vocab_size: int | None = None,
    block_size: int | None = None,
    n_layer: int | None = None,
    n_head: int | None = None,
    n_embd: int | None = None,
    dropout: float = 0.0,
    bias: bool = True,
    preset: str | None = None,
) -> GPT:
    """Build a GPT; ``preset="gpt2"`` gives GPT-2 small, explicit arguments override it."""
    fields: dict[str, int] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"gpt: preset must be one of {sorted(PRESETS)}, got {preset!r}")
        fields.update(PRESETS[preset])
    given = {
        "vocab_size": vocab_size,
        "block_size": block_size,
        "n_layer": n_layer,
        "n_head": n_head,
        "n_embd": n_embd,
    }
    fields.update({key: value for key, value in given.items() if value is not None})
    return GPT(GPTConfig(**fields, dropout=dropout, bias=bias))
