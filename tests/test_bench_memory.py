"""The memory benchmark (``superneurons bench memory``) and the cuDNN workspace controls.

CPU: every plan the benchmark measures fits its budget and its prediction (within 3%), the
anchors are measured in the same run, the verdicts follow from the records, and the command
writes its three artifacts. CUDA (skipped without a device): the same run on real CUDA tensors
with ``max_memory_allocated``, and the allocator cap of :mod:`superneurons.memory.profiling.workspace`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from superneurons.bench.memory.report import verdicts
from superneurons.bench.memory.run import MODELS, MemoryBenchConfig, run_memory_bench
from superneurons.commands import bench_memory
from superneurons.errors import ConfigError
from superneurons.memory.profiling.workspace import (
    cudnn_settings,
    limit_workspace,
    untracked_peak_bytes,
)

TINY = dict(batch_size=4, block_size=64, steps=1, budgets=(0.9, 0.8))
NO_COMPILE = ("eager", "ours", "ours-offload", "checkpoint", "selective", "save_on_cpu")


def _check_ours(records: list[dict], *, offload_predicted: bool = False) -> int:
    """Every measured plan fits its budget; plans without offload units (all of them with
    ``offload_predicted``) are within 3% of their prediction. Returns how many were measured."""
    eager = next(r for r in records if r["method"] == "eager")
    measured = 0
    for r in records:
        if r["method"] not in ("ours", "ours-offload") or "skipped" in r:
            continue
        measured += 1
        assert r["peak_bytes"] <= r["budget_fraction"] * eager["peak_bytes"], r
        if offload_predicted or not r["actions"].get("offload"):
            assert abs(r["peak_bytes"] - r["predicted_peak_bytes"]) <= 0.03 * r["peak_bytes"], r
    return measured


@pytest.mark.parametrize("model", ["gpt", "hf-gpt2"])
def test_cpu_bench_plans_fit_and_anchors_run(model: str) -> None:
    if model == "hf-gpt2":
        pytest.importorskip("transformers")
    config = MemoryBenchConfig(model=model, tiny=True, methods=NO_COMPILE, **TINY)  # type: ignore[arg-type]
    records = run_memory_bench(config)
    assert _check_ours(records) >= 1, "some budget must be feasible"
    for anchor in ("checkpoint", "selective", "save_on_cpu"):
        (row,) = [r for r in records if r["method"] == anchor]
        assert row["peak_bytes"] > 0 and row["step_s"] > 0
    eager = next(r for r in records if r["method"] == "eager")
    assert eager["workspace_bytes"] == 0  # no workspaces outside tensors on CPU
    for verdict in verdicts(records):
        if "fits" in verdict:
            assert verdict["fits"]
            if verdict["fastest_anchor"] is None:
                assert verdict["anchor_ok"] == verdict["fits"]


def test_cpu_bench_offload_chain_prediction_within_3_percent() -> None:
    config = MemoryBenchConfig(
        model="gpt", methods=("eager", "ours-offload"), batch_size=8, block_size=128, steps=1,
        budgets=(0.75,),
    )  # fmt: skip
    assert _check_ours(run_memory_bench(config), offload_predicted=True) >= 1


def test_verdicts_pick_the_fastest_fitting_anchor() -> None:
    def rec(method: str, peak: int, step: float, **extra: object) -> dict:
        return {"model": "m", "method": method, "peak_bytes": peak, "step_s": step, **extra}

    records = [
        rec("eager", 100, 1.0),
        rec("ours", 48, 1.2, budget_fraction=0.5, predicted_peak_bytes=47),
        rec("checkpoint", 45, 1.5),
        rec("save_on_cpu", 30, 9.0),
        rec("selective", 60, 1.1),  # faster, but over the budget
    ]
    (verdict,) = verdicts(records)
    assert verdict["fits"] and verdict["fastest_anchor"] == "checkpoint"
    assert verdict["vs_fastest_anchor"] == pytest.approx(1.2 / 1.5)
    assert verdict["anchor_ok"] is True  # 0.8 <= 0.9
    assert verdict["prediction_ok"] is True  # 48 vs 47: +2.1%


def test_command_writes_json_markdown_png(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench_memory.add_arguments(parser)
    args = parser.parse_args(
        ["--model", "gpt", "--quick", "--batch", "2", "--block-size", "64", "--budgets", "75,50",
         "--anchors", "checkpoint", "--out", str(tmp_path)]
    )  # fmt: skip
    assert bench_memory.run(args) == 0
    body = json.loads((tmp_path / "memory.json").read_text())
    assert {"environment", "config", "cudnn", "verdicts", "records"} <= set(body)
    assert body["config"]["device"] == "cpu"
    methods = {r["method"] for r in body["records"]}
    assert {"eager", "ours", "checkpoint", "compile"} <= methods  # compile: a 'not run' record
    assert (tmp_path / "memory.png").stat().st_size > 0
    assert "Verdicts" in (tmp_path / "memory.md").read_text()
    rerender = parser.parse_args(["--render-only", "--out", str(tmp_path)])
    assert bench_memory.run(rerender) == 0  # same records, page rewritten from the JSON
    assert "Measured by" in (tmp_path / "memory.md").read_text()
    with pytest.raises(ConfigError, match="does not exist"):
        bench_memory.run(parser.parse_args(["--render-only", "--out", str(tmp_path / "none")]))


def test_bad_anchor_and_budget_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown"):
        bench_memory._anchors("checkpoint,nonsense", device="cpu", no_compile=False)
    assert "compile" not in bench_memory._anchors(None, device="cpu", no_compile=False)
    assert bench_memory._anchors("all", device="cpu", no_compile=True) == (
        "checkpoint",
        "selective",
        "save_on_cpu",
    )
    with pytest.raises(ConfigError, match="percentages"):
        bench_memory._budgets("half")
    with pytest.raises(ConfigError, match="fractions"):
        MemoryBenchConfig(budgets=(1.5,))


def test_workspace_controls_are_noops_on_cpu() -> None:
    conv = nn.Conv2d(3, 8, 3)
    x = torch.randn(2, 3, 16, 16)
    assert untracked_peak_bytes(lambda: conv(x).sum().backward(), device="cpu") == 0
    with limit_workspace(cap_bytes=1, device="cpu") as cap:
        assert cap.cap_bytes == 0  # nothing to cap on CPU
    settings = cudnn_settings()
    assert {"benchmark", "deterministic", "allow_tf32", "env"} <= set(settings)


@pytest.mark.cuda
def test_cuda_bench_measures_max_memory_allocated() -> None:
    config = MemoryBenchConfig(model="gpt", device="cuda", methods=NO_COMPILE, **TINY)  # type: ignore[arg-type]
    records = run_memory_bench(config)
    eager = next(r for r in records if r["method"] == "eager")
    assert eager["peak_bytes"] > 0 and eager["step_cpu_s"] is None  # CUDA-event timing
    assert _check_ours(records) >= 1


@pytest.mark.cuda
def test_cuda_workspace_cap_bounds_the_step_and_restores_settings() -> None:
    device = torch.device("cuda")
    conv = nn.Conv2d(64, 64, 3, padding=1).to(device)
    x = torch.randn(32, 64, 56, 56, device=device)

    def step() -> None:
        conv(x).sum().backward()

    step()
    extra = untracked_peak_bytes(step, resident=[*conv.parameters(), x], device=device)
    assert extra >= 0
    before = (torch.cuda.get_per_process_memory_fraction(device), torch.backends.cudnn.benchmark)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    cap_bytes = torch.cuda.memory_allocated(device) + (256 << 20)
    with limit_workspace(cap_bytes=cap_bytes, device=device) as cap:
        assert 0 < cap.fraction < 1 and torch.backends.cudnn.benchmark is False
        step()
        torch.cuda.current_stream(device).synchronize()
        assert torch.cuda.max_memory_reserved(device) <= cap_bytes
    after = (torch.cuda.get_per_process_memory_fraction(device), torch.backends.cudnn.benchmark)
    assert after == before


@pytest.mark.parametrize("model", MODELS)
def test_every_anchor_runs_every_bench_model_with_eager_gradients(model: str) -> None:
    """checkpoint, selective and save_on_cpu on each model the benchmark offers (ResNet-50's
    in-place ReLU after a unit boundary included): the step runs and its gradients are
    bitwise eager's (recomputation replays the same ops and the same dropout draws)."""
    from superneurons.bench.memory.anchors import checkpointed_units, save_on_cpu
    from superneurons.bench.memory.run import _build, _no_kv_cache
    from superneurons.memory.profile_types import default_units

    if model == "hf-gpt2":
        pytest.importorskip("transformers")
    config = MemoryBenchConfig(model=model, tiny=True, batch_size=2, image_size=32, block_size=32)
    net, inputs, targets, loss_fn = _build(config)
    net.train()
    units = default_units(net)

    def gradients(anchor: str | None) -> dict[str, torch.Tensor]:
        net.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout draws in every run
        context: Any = contextlib.nullcontext()
        if anchor == "save_on_cpu":
            context = save_on_cpu(torch.device("cpu"))
        elif anchor is not None:
            context = checkpointed_units(net, units, selective=anchor == "selective")
        with _no_kv_cache(net), context:
            loss_fn(net(inputs), targets).backward()
        return {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}

    eager = gradients(None)
    assert eager, "no gradient at all"
    for anchor in ("checkpoint", "selective", "save_on_cpu"):
        got = gradients(anchor)
        assert got.keys() == eager.keys(), anchor
        for name, grad in eager.items():
            assert torch.equal(got[name], grad), f"{model} {anchor}: {name}"


@pytest.mark.slow  # a ResNet-50 step at 64 px: ~20 s on a loaded 2-core CPU
def test_quick_resnet50_gives_the_planner_activations_to_trade(tmp_path: Path) -> None:
    """--quick sizes ResNet-50 so that activations dominate: half of eager's peak is a plan
    that fits, not an infeasible budget."""
    parser = argparse.ArgumentParser()
    bench_memory.add_arguments(parser)
    args = parser.parse_args(
        ["--model", "resnet50", "--quick", "--budgets", "50", "--anchors", "none", "--out", str(tmp_path)]
    )  # fmt: skip
    assert bench_memory.run(args) == 0
    records = json.loads((tmp_path / "memory.json").read_text())["records"]
    planned = [r for r in records if r["method"] in ("ours", "ours-offload")]
    assert len(planned) == 2
    eager = next(r for r in records if r["method"] == "eager")
    for record in planned:
        assert "skipped" not in record, record
        assert record["peak_bytes"] <= 0.5 * eager["peak_bytes"], record
