"""The demo's code path end to end at a tiny size: two real 2-rank runs and a report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from superneurons.demo import DemoConfig, run_demo
from superneurons.errors import ConfigError


@pytest.mark.slow
@pytest.mark.dist
def test_demo_end_to_end_tiny(tmp_path: Path) -> None:
    messages: list[str] = []
    config = DemoConfig(out_dir=tmp_path, limit_steps=3, batch_size=16, budget_fraction=0.6)
    report = run_demo(config, progress=messages.append)
    assert report == tmp_path / "report.md"
    text = report.read_text()
    for image in ("curves.png", "bytes.png", "memory.png"):
        assert f"({image})" in text
        assert (tmp_path / image).stat().st_size > 10_000  # a real plot, not an empty file
    memory = json.loads((tmp_path / "memory.json").read_text())
    assert memory["planned_peak_bytes"] <= memory["budget_bytes"] < memory["eager_peak_bytes"]
    dense = json.loads((tmp_path / "dense" / "summary.json").read_text())
    ours = json.loads((tmp_path / "superneurons" / "summary.json").read_text())
    assert dense["codec"] == "dense" and ours["codec"].startswith("fft:")
    assert ours["bytes_per_step"] < dense["bytes_per_step"] / 10
    assert any(m.startswith("[4/4]") for m in messages)


@pytest.mark.parametrize(
    "kwargs", [{"nproc": 0}, {"budget_fraction": 0.0}, {"budget_fraction": 1.5}, {"limit_steps": 0}]
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
