"""CompressedDDPStrategy registers every kind of hook on CPU too (Lightning itself registers
``ddp_comm_hook`` only on CUDA), and the Lightning example with PyTorch's fp16 anchor."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed import Ranks, shared_ranks
from integrations_support import ROOT
from superneurons.errors import ConfigError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="lightning not installed"
)

_CALLS = {"hook": 0}


def _counting_fp16_hook(state, bucket):  # type: ignore[no-untyped-def]
    """PyTorch's fp16 hook, counting its calls (a raw ``ddp_comm_hook=`` for the strategy).

    Unannotated: DDP compares annotations with ``dist.GradBucket``, and this module's are
    strings (``from __future__ import annotations``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    _CALLS["hook"] += 1
    return default_hooks.fp16_compress_hook(state, bucket)


def _strategy_trains(rank: int, world_size: int, how: str) -> dict[str, Any]:
    from superneurons.integrations.lightning import CompressedDDPStrategy

    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
    if how == "raw":
        strategy = CompressedDDPStrategy(ddp_comm_hook=_counting_fp16_hook)
    else:
        strategy = CompressedDDPStrategy(how)
    strategy.model = ddp  # what DDPStrategy.configure_ddp sets before registering hooks
    strategy._register_ddp_hooks()
    _CALLS["hook"] = 0
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * rank + step)
        optimizer.zero_grad()
        ddp(torch.randn(16, 8, generator=gen)).square().mean().backward()
        optimizer.step()
    state = strategy.compression_state
    return {
        "params": [p.detach().clone() for p in ddp.parameters()],
        "calls": _CALLS["hook"],
        "sent": state.bytes_sent_total if state else None,
        "dense": state.dense_bytes_step * state.step if state else None,
        "steps": state.step if state else None,
    }


@pytest.fixture(scope="module")
def ranks() -> Ranks:
    return shared_ranks(2)


@pytest.mark.dist
@pytest.mark.parametrize("how", ["torch-fp16", "torch-powersgd:rank=1", "topk:ratio=0.1", "raw"])
def test_hook_runs_on_cpu_and_ranks_agree(ranks: Ranks, how: str) -> None:
    results = ranks.run(_strategy_trains, how, timeout_s=120)
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)
    for r in results:
        if how == "raw":
            assert r["calls"] == 3  # one bucket, three backward passes
            continue
        assert r["steps"] == 3
        if how == "torch-fp16":
            assert r["sent"] * 2 == r["dense"]  # fp16 on the wire: half of fp32
        else:
            assert 0 < r["sent"] < r["dense"]


def _strategy_trains_lora(rank: int, world_size: int) -> dict[str, Any]:
    """A PEFT LoRA model under DDP with compression through the strategy: only the adapters
    have gradients to average; the frozen base stays as it was."""
    from adapters_support import IDS, lora_llama
    from superneurons.integrations.lightning import CompressedDDPStrategy

    model = lora_llama()
    base = [p for p in model.parameters() if not p.requires_grad]
    frozen = [p.detach().clone() for p in base]
    ddp = DistributedDataParallel(model)
    strategy = CompressedDDPStrategy("topk:ratio=0.1")
    strategy.model = ddp
    strategy._register_ddp_hooks()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(2):
        torch.manual_seed(10 * rank + step)
        ids = IDS.roll(rank + step, dims=1)  # each rank its own batch
        optimizer.zero_grad()
        ddp(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    state = strategy.compression_state
    assert state is not None
    return {
        "adapters": [p.detach().clone() for p in model.parameters() if p.requires_grad],
        "frozen_unchanged": all(torch.equal(a, b) for a, b in zip(frozen, base, strict=True)),
        "sent": state.bytes_sent_total,
        "dense": state.dense_bytes_step * state.step,
    }


@pytest.mark.dist
@pytest.mark.slow
def test_lora_adapters_train_under_the_strategy(ranks: Ranks) -> None:
    pytest.importorskip("peft")
    results = ranks.run(_strategy_trains_lora, timeout_s=180)
    for a, b in zip(results[0]["adapters"], results[1]["adapters"], strict=True):
        assert torch.equal(a, b)
    for r in results:
        assert r["frozen_unchanged"] and 0 < r["sent"] < r["dense"]


def test_conflicting_or_missing_hooks_are_refused() -> None:
    from superneurons.compress import DeferredCompression
    from superneurons.integrations.lightning import CompressedDDPStrategy

    with pytest.raises(ConfigError, match="needs compression"):
        CompressedDDPStrategy()
    with pytest.raises(ConfigError, match="not both"):
        CompressedDDPStrategy("torch-fp16", ddp_comm_hook=_counting_fp16_hook)
    with pytest.raises(ConfigError, match="unknown codec"):
        CompressedDDPStrategy("fft-typo:theta=0.9")
    with pytest.raises(ConfigError, match="own options"):
        deferred = DeferredCompression(nn.Linear(2, 2), "fft:theta=0.9,bits=8")
        CompressedDDPStrategy(deferred, compression_options={"warmup_steps": 1})


@pytest.mark.dist
@pytest.mark.slow
def test_lightning_example_runs_pytorch_fp16_anchor_on_cpu(tmp_path: Path) -> None:
    command = [sys.executable, "examples/lightning_ddp.py", "--max-steps", "4"]
    command += ["--compress", "torch-fp16", "--out", str(tmp_path)]
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "result.json").read_text())
    assert record["codec"] == "torch-fp16" and record["steps"] == 4
    assert record["compression_ratio"] == 2.0  # the fp16 hook ran: half the bytes of fp32
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]
    assert ranks[0]["steps"] == 4
