"""The demo's code path end to end at a tiny size: two real 2-rank runs and a report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from superneurons.demo import DemoConfig, run_demo
from superneurons.errors import ConfigError

TINY_LLAMA = {
    "model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 256,
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.dist
def test_demo_quick_end_to_end_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--quick``'s every part at a tiny size (on loopback: the shaped launch is the netns
    tests'; the TRL part's Llama with a 2,048-token vocabulary instead of 32,000: the same
    code in less time), and the report's first screen read back from ``demo.json``."""
    from dataclasses import replace

    import superneurons.demo.lm
    from superneurons.demo.report import headline

    monkeypatch.setattr(superneurons.demo.lm, "TINY_VOCAB", 2048)

    config_json = tmp_path / "tiny-llama.json"
    config_json.write_text(json.dumps(TINY_LLAMA))
    messages: list[str] = []
    config = replace(
        DemoConfig(out_dir=tmp_path / "demo").as_quick(),
        limit_steps=2, epochs=1, batch_size=16, budget_fraction=0.6, shaping=False,
        time_budget_s=1e6, evals=1, eval_limit=32, lm_models=(str(config_json),), lm_tunings=("full", "qlora"),
        lm_seq_len=64, lm_steps=1,
    )  # fmt: skip
    report = run_demo(config, progress=messages.append)
    out = tmp_path / "demo"
    assert report == out / "report.md"
    text = report.read_text()
    for image in ("race.png", "curves.png", "bytes.png", "memory.png", "lm.png"):
        assert f"({image})" in text
        assert (out / image).stat().st_size > 10_000  # a real plot, not an empty file
    demo = json.loads((out / "demo.json").read_text())
    assert text.splitlines()[:5] == headline(demo)
    assert "LOOPBACK" in text.splitlines()[0] and demo["link"]["loopback_reason"] == "--no-shaping"
    race = demo["race"]
    assert race["dense_steps"] == race["superneurons_steps"] == 2  # one epoch of 2 steps each
    assert demo["time_to_dense_accuracy_ratio"] == race["time_to_dense_accuracy_ratio"]
    memory = json.loads((out / "memory.json").read_text())
    assert memory["planned_peak_bytes"] <= memory["budget_bytes"] < memory["eager_peak_bytes"]
    dense = json.loads((out / "dense" / "summary.json").read_text())
    ours = json.loads((out / "superneurons" / "summary.json").read_text())
    assert dense["codec"] == "dense" and ours["codec"].startswith("fft:")
    assert ours["bytes_per_step"] < dense["bytes_per_step"] / 10
    full, qlora = demo["lm"]["what_fits"]
    assert (full["tuning"], qlora["tuning"]) == ("full", "qlora")
    assert full["superneurons_bytes"] <= full["hf_checkpointing_bytes"]
    assert qlora["superneurons_bytes"] <= qlora["hf_checkpointing_bytes"]
    assert "--quantize nf4" in qlora["command"]
    trl = demo["lm"]["trl"]
    assert trl["first_loss_identical"] and trl["loss_max_rel_diff"] < 1e-5
    assert trl["within_budget"]
    assert any(m.startswith("[5/5]") for m in messages)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"nproc": 0},
        {"budget_fraction": 0.0},
        {"budget_fraction": 1.5},
        {"limit_steps": 0},
        {"time_budget_s": 0.0},
        {"evals": 0},
        {"lm_steps": 0},
        {"rate_bit_s": 100},
    ],
)
def test_demo_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        DemoConfig(**kwargs)


@pytest.mark.parametrize(
    ("gpus", "nproc", "ranks"), [(0, None, 2), (1, None, 1), (4, None, 2), (1, 3, 3)]
)
def test_demo_ranks_default_to_the_gpus(
    monkeypatch: pytest.MonkeyPatch, gpus: int, nproc: int | None, ranks: int
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert DemoConfig(nproc=nproc).ranks == ranks
