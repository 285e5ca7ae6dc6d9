"""``superneurons train`` with an optimizer that communicates (1-bit Adam) and Adam's ``auto``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from distributed import Ranks, shared_ranks
from superneurons.cli import main
from superneurons.train.config import TrainConfig
from train_support import (
    STATED_COMPUTE,
    load_checkpoint,
    mlp_config,
    needs_data,
    run_rank,
    run_rank_stated,
)

ONE_BIT = "adam-momentum[warmup=2,wire=fp16]:signsgd"
pytestmark = needs_data


@pytest.fixture(scope="module")
def ranks() -> Ranks:
    return shared_ranks(2)


def _config(out_dir: Path, **overrides: Any) -> TrainConfig:
    return mlp_config(out_dir, **{"optimizer": "adamw", **overrides})


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.slow
@pytest.mark.dist
def test_one_bit_adam_resumes_bitwise_and_counts_its_bytes(ranks: Ranks, tmp_path: Path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    (summary, _) = ranks.run(run_rank, _config(straight, compress=ONE_BIT, epochs=2), timeout_s=120)
    ranks.run(run_rank, _config(split, compress=ONE_BIT, epochs=1), timeout_s=120)
    ranks.run(run_rank, _config(split, compress=ONE_BIT, epochs=2, resume=True), timeout_s=120)
    for rank in range(2):
        a, b = load_checkpoint(straight, rank), load_checkpoint(split, rank)
        assert a["step"] == b["step"] == 6
        for key in ("model", "optimizer", "compression", "rng"):
            assert _same(a[key], b[key]), f"rank{rank}.{key}"
    # the error-feedback residuals are in each rank's optimizer state, and differ by rank
    residuals = [
        load_checkpoint(straight, r)["optimizer"]["state"][0]["residual"] for r in range(2)
    ]
    assert not torch.equal(*residuals)
    # the bytes are the optimizer's payloads: 2 fp16 warm-up steps, then 4 sign steps
    assert summary["codec"] == summary["compression"] == ONE_BIT
    dense = summary["dense_bytes_per_step"]
    assert dense == 4 * summary["parameters"]
    assert dense / 2 * 2 / 6 < summary["bytes_per_step"] < dense / 2
    assert (
        json.loads((straight / "summary.json").read_text())["bytes_per_step"]
        == (summary["bytes_per_step"])
    )


@pytest.mark.dist
def test_auto_chooses_by_the_link_and_trains_as_the_chosen_scheme(
    ranks: Ranks, tmp_path: Path
) -> None:
    spec = "adam-momentum[warmup=20,wire=fp16]:signsgd"  # auto's scheme for a run this short
    runs = {
        "slow": "auto:link=10kbit",
        "fast": "auto:link=1000gbit",
        "one-bit": spec,
        "dense": "dense",
    }
    summaries = {}
    for name, compress in runs.items():  # auto decides from the stated link and compute
        config = _config(tmp_path / name, compress=compress)
        summaries[name] = ranks.run(run_rank_stated, config, timeout_s=120)[0]
    slow, fast = summaries["slow"]["sync_decision"], summaries["fast"]["sync_decision"]
    assert fast["backward_s"] == STATED_COMPUTE.backward_s  # nothing measured entered
    assert slow["scheme"] == summaries["slow"]["codec"] == spec
    assert slow["predicted_compressed_step_s"] < slow["predicted_dense_step_s"]
    assert fast["scheme"] == summaries["fast"]["codec"] == "dense"
    assert summaries["slow"]["compression"] == "auto:link=10kbit"
    assert "stated" in slow["link"] and "stated" in fast["link"]
    for auto, fixed in (("slow", "one-bit"), ("fast", "dense")):  # deciding changes nothing
        for rank in range(2):
            a, b = load_checkpoint(tmp_path / auto, rank), load_checkpoint(tmp_path / fixed, rank)
            assert _same(a["model"], b["model"]) and _same(a["optimizer"], b["optimizer"])
        assert summaries[auto]["bytes_per_step"] == summaries[fixed]["bytes_per_step"]


@pytest.mark.dist
def test_auto_resumes_with_its_saved_decision(ranks: Ranks, tmp_path: Path) -> None:
    out = tmp_path / "auto"
    ranks.run(run_rank, _config(out, compress="auto:link=10kbit", epochs=1), timeout_s=120)
    first = load_checkpoint(out, 0)["compression"]["decision"]
    (summary, _) = ranks.run(
        run_rank, _config(out, compress="auto:link=10kbit", epochs=2, resume=True), timeout_s=120
    )
    assert summary["sync_decision"] == first  # restored, not measured again
    for rank in range(2):
        assert load_checkpoint(out, rank)["compression"]["decision"] == first


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--compress", ONE_BIT], "--optimizer adamw"),
        (["--compress", ONE_BIT, "--optimizer", "adamw", "--warmup-steps", "5"], "warm-up"),
        (["--compress", ONE_BIT, "--optimizer", "adamw", "--no-error-feedback"], "feedback"),
        (["--compress", "auto:link=fast", "--optimizer", "adamw"], "rate"),
        (["--compress", "auto:latency=50us", "--optimizer", "adamw"], "link=1gbit"),
        (["--compress", "auto:link=1gbit,latency=fast", "--optimizer", "adamw"], "50us"),
        (["--compress", "auto:observe_steps=2", "--optimizer", "adam"], "--optimizer sgd"),
    ],
)
def test_bad_combinations_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    command = ["train", "--model", "mlp", "--data", "fashion-mnist", *flags]
    assert main([*command, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
