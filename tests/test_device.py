"""Device placement: which backend and device a rank gets, and that nothing is left behind.

The GPU count is faked (``torch.cuda.is_available``/``device_count`` monkeypatched), so the
policy is tested the same on a CPU box and on a GPU box.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from distributed import Ranks, shared_ranks
from superneurons.device import Placement, choose_backend, rank_device
from superneurons.errors import ConfigError

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize(
    ("gpus", "nproc", "backend", "expected", "noted"),
    [
        (0, 2, "auto", "gloo", False),
        (1, 1, "auto", "nccl", False),
        (1, 2, "auto", "gloo", True),  # fewer GPUs than ranks: CPU for all, said once
        (4, 2, "auto", "nccl", False),
        (1, 1, "nccl", "nccl", False),
        (2, 2, "gloo", "gloo", False),
    ],
)
def test_backend_policy(
    monkeypatch: pytest.MonkeyPatch, gpus: int, nproc: int, backend: str, expected: str, noted: bool
) -> None:
    _fake_gpus(monkeypatch, gpus)
    choice = choose_backend(backend, local_world_size=nproc)
    assert choice.backend == expected
    assert (choice.note is not None) == noted
    if noted:
        assert f"--nproc {gpus}" in choice.note and "\n" not in choice.note


@pytest.mark.parametrize(("gpus", "nproc"), [(0, 1), (1, 2)])
def test_nccl_without_a_gpu_per_rank_stops_with_what_to_pass(
    monkeypatch: pytest.MonkeyPatch, gpus: int, nproc: int
) -> None:
    _fake_gpus(monkeypatch, gpus)
    with pytest.raises(ConfigError, match="--backend gloo"):
        choose_backend("nccl", local_world_size=nproc)


def test_local_rank_never_maps_to_a_missing_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, 1)
    assert rank_device("nccl", 0) == torch.device("cuda", 0)
    assert rank_device("gloo", 1) == torch.device("cpu")
    with pytest.raises(ConfigError, match="local rank 1 has no GPU"):
        rank_device("nccl", 1)  # was: cuda:1, "invalid device ordinal" on a 1-GPU box


def test_rank_joins_gloo_on_cpu_when_its_node_has_too_few_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist

    from superneurons.train import rank

    _fake_gpus(monkeypatch, 1)
    joined: list[str] = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **_: joined.append(backend))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    placement = rank.init_distributed("auto")
    assert joined == ["gloo"] and placement.device == torch.device("cpu")


def _train_flags(out: Path, *extra: str) -> list[str]:
    return ["train", "--model", "mlp", "--data", "fashion-mnist", "--out", str(out), *extra]


@pytest.mark.skipif(not FASHION_MNIST.exists(), reason="Fashion-MNIST not installed")
def test_cli_says_in_one_line_that_ranks_run_on_cpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from superneurons.cli import main
    from superneurons.train import launch

    _fake_gpus(monkeypatch, 1)
    launched: list[int] = []
    monkeypatch.setattr(launch, "run_torchrun", lambda lc, _path: launched.append(lc.nproc) or 0)
    assert main(_train_flags(tmp_path, "--nproc", "2")) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert launched == [2]
    assert len(err) == 1 and "CPU with gloo" in err[0] and "--nproc 1" in err[0]


@pytest.mark.skipif(not FASHION_MNIST.exists(), reason="Fashion-MNIST not installed")
def test_cli_stops_nccl_before_launching(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from superneurons.cli import main
    from superneurons.train import launch

    _fake_gpus(monkeypatch, 1)
    monkeypatch.setattr(launch, "run_torchrun", lambda *_: pytest.fail("ranks were started"))
    assert main(_train_flags(tmp_path, "--nproc", "2", "--backend", "nccl")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--nproc 1" in err[0]


def test_placement_moves_every_tensor_at_any_depth() -> None:
    pair = collections.namedtuple("pair", "image label")
    batch = {
        "x": torch.ones(2),
        "nested": [pair(torch.zeros(1), torch.ones(1)), (torch.ones(3), "keep", 7)],
    }
    moved = Placement(torch.device("meta")).batch(batch)
    assert moved["x"].device.type == "meta"
    assert isinstance(moved["nested"][0], pair) and moved["nested"][0].label.is_meta
    assert moved["nested"][1][0].is_meta and moved["nested"][1][1:] == ("keep", 7)
    assert not Placement().pin_memory and Placement(torch.device("cuda", 0)).pin_memory


# --------------------------------------------------------------------------- through the loop

FAKE = "fake:0"  # a device label only the placement hands out


def _device_of(tensor: torch.Tensor) -> str:
    return getattr(tensor, "fake_device", str(tensor.device))


class TaggingPlacement(Placement):
    """The CPU, labelled as another device: what it moves carries the label, nothing else does,
    so a tensor that bypassed the placement is on a different "device" than the parameters."""

    def module(self, model: nn.Module) -> nn.Module:
        model = super().module(model)
        # NOTE: on the modules, not the parameters: Parameter.__deepcopy__ (the memory
        # profiler copies the model) drops Python attributes, Module's deepcopy keeps them.
        for module in model.modules():
            module.fake_device = FAKE
        return model

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        moved = super().tensor(tensor).detach()  # a new tensor object: the loader's stays bare
        moved.fake_device = FAKE  # type: ignore[attr-defined]
        return moved


class DeviceChecked(nn.Module):
    """Wraps a model; its forward asserts the input is where the parameters are."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        params_on = getattr(self, "fake_device", str(next(self.parameters()).device))
        assert _device_of(inputs) == params_on, (
            f"batch on {_device_of(inputs)}, parameters on {params_on}"
        )
        self.calls += 1
        return self.inner(inputs)


def _train_checked(rank: int, world_size: int, config: Any, placement: Placement) -> int:
    from superneurons.train import loop

    original = loop.build_task
    checked: list[DeviceChecked] = []

    def build(*args: Any, **kwargs: Any) -> Any:
        task = original(*args, **kwargs)
        task.model = DeviceChecked(task.model)
        checked.append(task.model)
        loss_fn = task.loss_fn

        def checked_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            assert _device_of(targets) == FAKE, f"targets on {_device_of(targets)}"
            return loss_fn(output, targets)

        task.loss_fn = checked_loss
        return task

    loop.build_task = build
    try:
        loop.run_training(config, placement)
    finally:
        loop.build_task = original
    return checked[0].calls


@pytest.fixture(scope="module")
def ranks() -> Ranks:
    return shared_ranks(2)


@pytest.mark.dist
@pytest.mark.skipif(not FASHION_MNIST.exists(), reason="Fashion-MNIST not installed")
@pytest.mark.parametrize("budget_bytes", [None, 1 << 30])
def test_training_loop_leaves_no_batch_behind(
    ranks: Ranks, tmp_path: Path, budget_bytes: int | None
) -> None:
    from superneurons.train.config import TrainConfig

    config = TrainConfig(
        model="mlp",
        data="fashion-mnist",
        out_dir=str(tmp_path),
        batch_size=16,
        limit_steps=2,
        log_every=1,
        compress="topk:ratio=0.1",
        budget_bytes=budget_bytes,
    )
    calls = ranks.run(_train_checked, config, TaggingPlacement(), timeout_s=120)
    assert min(calls) >= 4  # 2 training steps + 2 test batches went through the check


def test_the_check_catches_a_batch_left_behind() -> None:
    placement = TaggingPlacement()
    model = placement.module(DeviceChecked(nn.Linear(2, 2)))
    model(placement.batch(torch.ones(1, 2)))
    with pytest.raises(AssertionError, match="batch on cpu, parameters on fake:0"):
        model(torch.ones(1, 2))  # not moved through the placement


@pytest.mark.cuda
def test_rank_device_on_a_real_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from superneurons.train.rank import init_distributed

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    placement = init_distributed("auto")
    try:
        assert dist.get_backend() == "nccl" and placement.device == torch.device("cuda", 0)
        batch = placement.batch((torch.ones(2).pin_memory(), [torch.zeros(1)]))
        assert batch[0].is_cuda and batch[1][0].is_cuda
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    from superneurons.train.launch import free_port

    return free_port()
