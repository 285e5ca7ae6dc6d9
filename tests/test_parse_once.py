"""A spec given on the command line is parsed exactly once per process.

The launcher parses ``--compress`` when it builds the :class:`TrainConfig`; a rank parses it once
when it reads ``config.json`` back (the process boundary), and everything after (the optimizer,
``auto``'s decision, the DDP hook, the training step) receives the object.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch

from distributed import Ranks
from superneurons.schemes import grammar

_SPECS = [
    ("fft:theta=0.5", "sgd"),
    ("ef(warmup(steps=1,topk:ratio=0.1))", "sgd"),
    ("powersgd:rank=2", "adam"),
    ("adam-momentum[warmup=1,wire=fp16]:signsgd", "adamw"),
    ("adam-update:qsgd", "adam"),
    ("auto:link=100mbit", "adamw"),
]


def _count_parses(monkeypatch: Any) -> collections.Counter[str]:
    """Count every parse of a whole spec (each entry to the grammar), by its text."""
    counts: collections.Counter[str] = collections.Counter()
    check = grammar._check_text

    def counted(text: object) -> None:
        counts[str(text)] += 1
        check(text)

    monkeypatch.setattr(grammar, "_check_text", counted)
    return counts


@pytest.mark.parametrize(("spec", "optimizer"), _SPECS)
def test_the_launcher_parses_the_spec_once(
    spec: str, optimizer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import superneurons.train.launch as launch
    import superneurons.train.precheck as precheck
    from superneurons.cli import main

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(precheck, "check_data_dir", lambda config: None)
    monkeypatch.setattr(precheck, "check_before_launch", lambda config, **_: None)
    monkeypatch.setattr(launch, "run_torchrun", lambda launch, config_path: 0)
    counts = _count_parses(monkeypatch)
    argv = ["train", "--model", "mlp", "--data", "fashion-mnist", "--out", str(tmp_path)]
    assert main([*argv, "--compress", spec, "--optimizer", optimizer, "--nproc", "2"]) == 0
    assert counts[spec] == 1
    assert (tmp_path / "config.json").exists()


def _one_rank(rank: int, world_size: int, config_json: str) -> dict[str, int]:
    """A rank's life with its spec: read the config, decide, attach, train two steps."""
    counts: collections.Counter[str] = collections.Counter()
    check = grammar._check_text

    def counted(text: object) -> None:
        counts[str(text)] += 1
        check(text)

    grammar._check_text = counted  # type: ignore[assignment]  # a spawned process of its own
    from torch.nn.parallel import DistributedDataParallel

    from superneurons.optim.autoadam import AdamDecision
    from superneurons.train.config import TrainConfig
    from superneurons.train.sync import attach_synchronisation, decide_scheme

    config = TrainConfig.from_json(config_json)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    loss_fn = torch.nn.functional.cross_entropy
    saved = None
    if config.compress.startswith("auto"):  # a resumed run: the checkpoint's decision, no timing
        decision = AdamDecision(None, 20, 1.0, 2.0, 0.1, "measured", {}, None)
        saved = {"decision": decision.to_dict()}
    decision = decide_scheme(
        config, model, batch=lambda: batch, loss_fn=loss_fn, total_steps=2, saved=saved
    )
    ddp = DistributedDataParallel(model)
    optimizer, sync = attach_synchronisation(config, model, ddp, decision=decision)
    for _ in range(2):
        optimizer.zero_grad()
        loss_fn(ddp(batch[0]), batch[1]).backward()
        optimizer.step()
    sync.summary()
    sync.state_dict()
    return dict(counts)


@pytest.mark.dist
def test_a_rank_parses_the_spec_once() -> None:
    from superneurons.train.config import TrainConfig

    configs = [
        TrainConfig(model="mlp", data="fashion-mnist", out_dir="/tmp", compress=s, optimizer=o)
        for s, o in _SPECS
    ]
    with Ranks(1) as ranks:
        for config in configs:
            (counts,) = ranks.run(_one_rank, config.to_json())
            assert counts.get(config.compress) == 1, (config.compress, counts)
