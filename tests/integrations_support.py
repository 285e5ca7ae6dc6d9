"""Shared by the integration tests: a tiny model called HF-style (``model(**batch)["loss"]``),
fast to build in spawned ranks unlike a transformers model, and running the examples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 32


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.drop = nn.Dropout(0.1)
        self.down = nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(self.drop(torch.nn.functional.gelu(self.up(h))))


class TinyLM(nn.Module):
    """Embedding, three residual MLP blocks (the plan's units), LM head; has a ``config``."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.config = SimpleNamespace(use_cache=True)
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(3)])
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        h = self.embed(input_ids)  # (B, T, C)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)  # (B, T, V)
        if labels is None:
            return {"logits": logits}
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def batch(seed: int, size: int = 4, seq: int = 16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, seq), generator=gen)
    return {"input_ids": ids, "labels": ids.roll(-1, dims=1)}


def torchrun(
    script: str, out: Path, *extra: str, timeout_s: float = 240
) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "localhost:0",
        "--log-dir",  # torchrun's own folder would stay in the system's temporary directory
        str(out / "torchrun"),
        script,
        "--out",
        str(out),
        *extra,
    ]
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def check_example_ranks(out: Path) -> dict[str, object]:
    """Both ranks agree bit for bit, compression ran and sent fewer bytes than dense."""
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]
    assert ranks[0]["plan"] == ranks[1]["plan"]
    record = ranks[0]
    assert record["compress_steps"] == record["steps"] > 0
    assert 0 < record["bytes_sent_step"] < record["dense_bytes_step"]
    assert record["bytes_sent_total"] == record["steps"] * record["bytes_sent_step"]
    assert record["predicted_peak_bytes"] <= record["budget_bytes"]
    return record
