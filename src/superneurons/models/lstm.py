"""A character-level LSTM language model (Hochreiter & Schmidhuber, 1997; the char-rnn setup of
Karpathy, 2015): embedding -> stacked ``nn.LSTM`` -> linear decoder.

``forward(idx: (B, T) int64) -> logits (B, T, vocab_size)``, the same interface as the GPT, so
the training loop and ``default_loss`` treat both language models alike.
"""

from __future__ import annotations

import torch
from torch import nn

from superneurons.errors import ConfigError

__all__ = ["CharLSTM", "lstm"]


class CharLSTM(nn.Module):
    def __init__(
        self,
        *,
        vocab_size: int,
        n_embd: int,
        hidden_size: int,
        num_layers: int,
        dropout: float,
        block_size: int,
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("n_embd", n_embd),
            ("hidden_size", hidden_size),
            ("num_layers", num_layers),
            ("block_size", block_size),
        ):
            if value < 1:
                raise ConfigError(f"lstm: {name} must be >= 1, got {value}")
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"lstm: dropout must be in [0, 1), got {dropout}")
        self.vocab_size = vocab_size
        self.block_size = block_size  # default training sequence length; any T works
        self.embedding = nn.Embedding(vocab_size, n_embd)
        self.rnn = nn.LSTM(
            n_embd,
            hidden_size,
            num_layers=num_layers,
            dropout=dropout if num_layers > 1 else 0.0,
            batch_first=True,
        )
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(hidden_size, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx)  # (B, T, n_embd)
        out, _ = self.rnn(x)  # (B, T, hidden)
        return self.decoder(self.drop(out))  # (B, T, vocab_size)


def lstm(
    *,
    vocab_size: int = 128,
    n_embd: int = 64,
    hidden_size: int = 256,
    num_layers: int = 2,
    dropout: float = 0.0,
    block_size: int = 128,
) -> CharLSTM:
    """A 2-layer, 256-unit char LSTM (~0.9M parameters at the defaults)."""
    return CharLSTM(
        vocab_size=vocab_size,
        n_embd=n_embd,
        hidden_size=hidden_size,
        num_layers=num_layers,
        dropout=dropout,
        block_size=block_size,
    )
