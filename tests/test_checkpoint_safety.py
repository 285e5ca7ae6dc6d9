"""A checkpoint folder someone else wrote cannot run code: every state file superneurons reads
back is read weights-only (tensors and plain data), on resume through the CLI and through the
Trainer callback, and what superneurons writes (PyTorch's PowerSGD hook state included) reads
back bit for bit."""

from __future__ import annotations

import ast
import copy
import importlib.util
import io
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed import Ranks, shared_ranks
from superneurons.cli import main
from superneurons.errors import CheckpointError
from superneurons.train.checkpoint import checkpoint_path
from train_support import needs_data

SRC = Path(__file__).resolve().parents[1] / "src" / "superneurons"


class _Payload:
    """Pickles as a call of ``os.makedirs(marker)``: what a planted checkpoint would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.makedirs, (self.marker,))


def _plant(path: Path, marker: Path) -> None:
    """A checkpoint-shaped file whose pickle runs the payload when fully unpickled."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"version": 1, "epoch": 1, "step": 1, "model": _Payload(marker)}, path)


def test_the_planted_payload_runs_under_an_unrestricted_load(tmp_path: Path) -> None:
    # the control: the file the tests below plant would run code if it were fully unpickled
    marker = tmp_path / "ran"
    _plant(tmp_path / "rank0.pt", marker)
    torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert marker.is_dir()


@needs_data
def test_cli_resume_refuses_a_planted_pickle_without_running_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, marker = tmp_path / "run", tmp_path / "ran"
    for rank in range(2):
        _plant(checkpoint_path(out, rank), marker)
    command = ["train", "--model", "mlp", "--data", "fashion-mnist", "--nproc", "2"]
    assert main([*command, "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "rank0.pt: refused: loading it would import" in err and "makedirs" in err
    assert not marker.exists()


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers not installed"
)
def test_trainer_callback_resume_refuses_a_planted_pickle_without_running_it(
    tmp_path: Path,
) -> None:
    from superneurons.integrations.transformers import SuperNeuronsCallback

    loaded: list[Any] = []
    callback = SuperNeuronsCallback(SimpleNamespace(accelerator=object()), compression="fp16")
    part = SimpleNamespace(load_state_dict=loaded.append)
    callback.setup = SimpleNamespace(compression=part, host_optimizer=None)  # type: ignore[assignment]
    args, state = SimpleNamespace(output_dir=str(tmp_path), process_index=0), SimpleNamespace()
    state.global_step = 2  # Trainer resumed from OUT/checkpoint-2
    path = tmp_path / "checkpoint-2" / "superneurons-compression-rank0.pt"
    path.parent.mkdir()
    torch.save({"step": 2, "residuals": {"w": torch.ones(3)}}, path)
    callback._resume(args, state)  # what on_train_begin runs when Trainer resumes
    assert len(loaded) == 1 and torch.equal(loaded[0]["residuals"]["w"], torch.ones(3))
    marker = tmp_path / "ran"
    _plant(path, marker)
    with pytest.raises(CheckpointError, match="refused: loading it would import .*makedirs"):
        callback._resume(args, state)
    assert not marker.exists() and len(loaded) == 1


def _torch_load_calls() -> list[str]:
    """Every ``torch.load(...)`` in the library that does not pass ``weights_only=True``."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr != "load" or ast.unparse(node.func.value) != "torch":
                continue
            safe = [k for k in node.keywords if k.arg == "weights_only"]
            if not (safe and isinstance(safe[0].value, ast.Constant) and safe[0].value.value):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    return found


def test_the_library_loads_state_weights_only() -> None:
    assert _torch_load_calls() == []


@pytest.fixture(scope="module")
def ranks() -> Ranks:
    return shared_ranks(2)


def _net() -> DistributedDataParallel:
    torch.manual_seed(0)
    return DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)))


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _torch_powersgd_resume(rank: int, world_size: int) -> dict[str, Any]:
    from superneurons.compress import register_compression

    spec = "torch-powersgd:rank=1"  # PyTorch's hook (with error feedback): compresses from step 2
    model = _net()
    state = register_compression(model, spec)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, range(4))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "hook": state.state_dict()}, buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert state.torch_state is not None
    pickled = copy.deepcopy(state.torch_state.__getstate__())  # what the old format held
    out: dict[str, Any] = {"saved": saved["hook"], "rng": state.torch_state.rng.get_state()}
    for how in ("tensors", "pickled"):
        resumed = _net()
        resumed.load_state_dict(saved["model"])
        resumed_state = register_compression(resumed, spec)
        resumed_state.load_state_dict(saved["hook"])
        assert resumed_state.torch_state is not None
        if how == "pickled":
            resumed_state.torch_state.__setstate__(pickled)
            resumed_state.torch_state.process_group = resumed_state.process_group
        else:
            out["again"] = resumed_state.state_dict()  # the restored state, written again
            out["restored_rng"] = resumed_state.torch_state.rng.get_state()
        _train(resumed, torch.optim.SGD(resumed.parameters(), lr=0.1), rank, range(4, 7))
        out[how] = [p.detach().clone() for p in resumed.parameters()]
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.dist
def test_torch_powersgd_state_round_trips_bit_exactly_weights_only(ranks: Ranks) -> None:
    for out in ranks.run(_torch_powersgd_resume, timeout_s=120):
        torch_state = out["saved"]["torch_powersgd"]
        assert torch_state["p_memory_dict"] and torch_state["error_dict"]  # both filled
        assert torch_state["rng"]["keys"].shape == (624,)  # MT19937's key, as a tensor
        assert _same(out["again"], out["saved"])
        kind, keys, *rest = out["restored_rng"]
        assert kind == out["rng"][0] and (keys == out["rng"][1]).all() and rest == [*out["rng"][2:]]
        # training on from the tensors is training on from the old pickle, bit for bit
        for a, b in zip(out["tensors"], out["pickled"], strict=True):
            assert torch.equal(a, b)
