"""The CUDA paths end to end on one GPU (skipped without one; see conftest.py).

What a user with a one-GPU machine runs: ``train --nproc 1`` on NCCL under a memory plan with a
gather codec (fft) and with PowerSGD, the demo, and ``register_compression`` on an NCCL group of
one rank. Each asserts the work ran on the GPU, not only that it exited 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cuda

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
needs_data = pytest.mark.skipif(
    not FASHION_MNIST.exists(), reason="Fashion-MNIST IDX files not installed"
)


@needs_data
@pytest.mark.parametrize("compress", ["fft", "powersgd:rank=4"])
def test_train_one_gpu_nccl_with_a_memory_plan(tmp_path: Path, compress: str) -> None:
    command = [sys.executable, "-m", "superneurons.cli", "train", "--model", "resnet"]
    command += ["--data", "fashion-mnist", "--nproc", "1", "--backend", "nccl"]
    command += ["--compress", compress, "--budget", "30MiB", "--limit-steps", "3"]
    command += ["--batch-size", "16", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["device"] == "cuda:0" and summary["backend"] == "nccl"
    assert summary["steps"] == 3 and summary["bytes_per_step"] > 0


@needs_data
@pytest.mark.slow
def test_demo_runs_on_the_gpu(tmp_path: Path) -> None:
    from superneurons.demo import DemoConfig, run_demo

    messages: list[str] = []
    config = DemoConfig(out_dir=tmp_path, limit_steps=3, batch_size=16, budget_fraction=0.6)
    report = run_demo(config, progress=messages.append)
    assert "cuda:0" in report.read_text() and torch.__version__ in report.read_text()
    for run in ("dense", "superneurons"):
        summary = json.loads((tmp_path / run / "summary.json").read_text())
        assert summary["device"] == "cuda:0" and summary["backend"] == "nccl"


def test_register_compression_on_nccl_world_size_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from superneurons.ddp.hook import register_compression
    from superneurons.train.launch import free_port
    from superneurons.train.rank import init_distributed

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    placement = init_distributed("nccl")
    try:
        torch.manual_seed(0)
        model = placement.module(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
        reference = [p.detach().clone() for p in model.parameters()]
        ddp = DistributedDataParallel(model, device_ids=[placement.device.index])
        state = register_compression(ddp, "identity")
        inputs, targets = placement.batch((torch.randn(32, 64), torch.randint(0, 10, (32,))))
        nn.functional.cross_entropy(ddp(inputs), targets).backward()
        # world size 1 and a lossless codec: DDP's gradient is the local one, on the GPU
        eager = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
        with torch.no_grad():
            for p, ref in zip(eager.parameters(), reference, strict=True):
                p.copy_(ref)
        nn.functional.cross_entropy(eager(inputs), targets).backward()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            assert p.grad is not None and p.grad.is_cuda
            torch.testing.assert_close(p.grad, q.grad)
        assert state.bytes_sent_step > 0
    finally:
        dist.destroy_process_group()
