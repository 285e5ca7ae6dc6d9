"""``scripts/gpu-check.sh``, the GPU acceptance run: its CPU dry run lists every step, it
refuses without a GPU in one line, and its figure readers understand what the steps write
(checked here on CPU runs of the same commands)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, SUPERNEURONS_PYTHON=sys.executable)
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_dry_run_lists_every_step_with_its_command_and_limit(tmp_path: Path) -> None:
    result = _script("--dry-run", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    steps = _module().STEPS
    names = [step.name for step in steps]
    assert {"cuda-tests", "demo", "memory-resnet50", "memory-gpt2", "codecs"} <= set(names)
    assert any(name.startswith("llm-") for name in names)
    assert sum(step.limit_s for step in steps) <= _module().TOTAL_LIMIT_S
    for index, name in enumerate(names, 1):
        assert f"[{index}] {name} (<= " in result.stdout
    commands = [line for line in result.stdout.splitlines() if "superneurons.cli" in line]
    resnet = next(c for c in commands if "--model resnet50" in c).split()
    gpt2 = next(c for c in commands if "--model gpt2" in c).split()
    for command, size in ((resnet, ["--image-size", "224"]), (gpt2, ["--block-size", "1024"])):
        assert {"--device", "cuda", "75,50,35,25", "all", *size} <= set(command)
    assert "pip" not in result.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_refuses_without_a_gpu_in_one_line(tmp_path: Path) -> None:
    result = _script(str(tmp_path / "out"))
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "no CUDA device" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_figure_readers_understand_the_steps_outputs(tmp_path: Path) -> None:
    gpu_check = _module()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    memory = tmp_path / "memory"
    bench = [sys.executable, "-m", "superneurons.cli", "bench", "memory", "--model", "gpt"]
    bench += ["--quick", "--batch", "2", "--block-size", "64", "--budgets", "75"]
    bench += ["--anchors", "checkpoint", "--out", str(memory)]
    subprocess.run(bench, env=env, capture_output=True, check=True, timeout=600)
    figures = gpu_check.memory_figures(memory)
    assert any(f["name"].startswith("checkpoint") and f["ok"] for f in figures)
    assert any(f["name"].startswith("ours @75%") for f in figures)
    codecs = tmp_path / "codecs"
    speed = [sys.executable, str(ROOT / "benchmarks" / "codec_hook_speed.py"), "--no-hook"]
    speed += ["--sizes", "262144", "--specs", "topk", "--repeats", "1", "--rounds", "1"]
    speed += ["--out", str(codecs)]
    subprocess.run(speed, env=env, capture_output=True, check=True, timeout=600, cwd=ROOT)
    bandwidth, codec = gpu_check.codec_figures(codecs)
    assert bandwidth["ok"] and codec["name"].startswith("topk 262,144 values")
    assert len(codec["value"]) == 4 and codec["value"][2] > 0  # rates and their fractions
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_x.py").write_text(
        "import pytest\n\ndef test_a():\n    pass\n\n"
        "@pytest.mark.skip(reason='no data')\ndef test_b():\n    pass\n"
    )
    junit = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(tests),
    ]
    junit += ["--junitxml", str(tests / "junit.xml"), str(tests / "test_x.py")]
    subprocess.run(junit, capture_output=True, check=True, timeout=300, cwd=tests)
    counts = {f["name"]: f for f in gpu_check.test_figures(tests)}
    assert counts["cuda tests run"]["value"] == 2 and counts["failed"]["ok"]
    assert counts["skipped"]["value"] == ["test_b: no data"] and counts["skipped"]["ok"] is False
