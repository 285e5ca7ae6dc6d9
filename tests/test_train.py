"""``superneurons train``: end to end through torchrun, exact resume, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from distributed import Ranks, shared_ranks
from superneurons.cli import main
from superneurons.train.checkpoint import checkpoint_path
from superneurons.train.config import TrainConfig
from train_support import (
    load_checkpoint,
    mlp_config,
    needs_data,
    run_rank,
    run_rank_planning_fails_on,
)


@pytest.fixture(scope="module")
def ranks() -> Ranks:
    return shared_ranks(2)


def _assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@needs_data
@pytest.mark.dist
@pytest.mark.parametrize("compress", ["qsgd", "powersgd:rank=2"])
def test_resume_continues_exactly(ranks: Ranks, tmp_path: Path, compress: str) -> None:
    straight = tmp_path / "straight"
    ranks.run(run_rank, mlp_config(straight, compress=compress, epochs=2), timeout_s=120)
    split = tmp_path / "split"
    ranks.run(run_rank, mlp_config(split, compress=compress, epochs=1), timeout_s=120)
    ranks.run(run_rank, mlp_config(split, compress=compress, epochs=2, resume=True), timeout_s=120)
    for rank in range(2):
        a, b = load_checkpoint(straight, rank), load_checkpoint(split, rank)
        assert a["epoch"] == b["epoch"] == 2 and a["step"] == b["step"] == 6
        for key in ("model", "optimizer", "compression", "rng"):
            _assert_same(a[key], b[key], f"rank{rank}.{key}")


@needs_data
@pytest.mark.dist
@pytest.mark.slow  # the launcher and two ranks start and import torch: ~23 s of CPU
def test_cli_end_to_end_on_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "run"
    command = [sys.executable, "-m", "superneurons.cli", "train", "--model", "mlp"]
    command += ["--data", "fashion-mnist", "--nproc", "2", "--compress", "topk:ratio=0.05"]
    command += ["--limit-steps", "4", "--log-every", "2", "--batch-size", "16", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=170, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [r["step"] for r in steps] == [2, 4]
    for record in steps:
        assert {"step", "epoch", "loss", "accuracy", "bytes_sent", "step_s"} <= record.keys()
    assert len(epochs) == 1 and {"test_accuracy", "test_loss"} <= epochs[0].keys()
    summary = json.loads((out / "summary.json").read_text())
    for key in ("final_test_accuracy", "final_test_loss", "wall_s", "mean_step_s", "codec"):
        assert key in summary
    assert summary["codec"] == "topk:ratio=0.05,select=exact"
    assert 0 < summary["bytes_per_step"] < summary["dense_bytes_per_step"]
    assert (out / "checkpoint" / "rank1.pt").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "gpt", "--data", "fashion-mnist"], "cannot train"),
        (["--model", "mlp", "--data", "fashion-mnist", "--compress", "nope"], "nope"),
        (["--model", "mlp", "--data", "fashion-mnist", "--epochs", "0"], "--epochs"),
        (["--model", "mlp", "--data", "fashion-mnist", "--optimizer", "lion"], "--optimizer"),
        (["--model", "mlp", "--data", "fashion-mnist", "--budget", "lots"], "size"),
        (["--model", "mlp", "--data", "fashion-mnist", "--nproc", "0"], "--nproc"),
        (["--model", "mlp", "--data", "fashion-mnist", "--resume"], "--resume"),
        (["--model", "mlp", "--data", "fashion-mnist", "--max-grad-norm", "-1"], "--max-grad"),
        (
            [
                "--model",
                "mlp",
                "--data",
                "fashion-mnist",
                "--optimizer",
                "adamw",
                "--compress",
                "adam-momentum[warmup=20]:signsgd",
                "--max-grad-norm",
                "1",
            ],
            "local gradients",
        ),  # fmt: skip
    ],
)
def test_bad_flags_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(["train", *flags, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_config_round_trips_through_json(tmp_path: Path) -> None:
    config = mlp_config(tmp_path, compress="fft:theta=0.9", budget_bytes=1 << 30)
    assert TrainConfig.from_json(config.to_json()) == config


def test_budget_seam_applies_a_memory_plan() -> None:
    from superneurons.models import build_model, default_loss
    from superneurons.train.loop import _apply_budget

    model = build_model("mlp")
    batch = (torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,)))
    handle = _apply_budget(model, batch, 1 << 30, loss_fn=default_loss("mlp"))
    try:
        loss = default_loss("mlp")(model(batch[0]), batch[1])
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
    finally:
        handle.remove()


@needs_data
@pytest.mark.dist
def test_rank_zero_plans_for_every_rank_and_its_failure_fails_them_all(
    ranks: Ranks, tmp_path: Path
) -> None:
    """Rank 0 plans for every rank, and its failure reaches all of them: a rank raising alone
    leaves the others waiting in a collective until the harness's timeout."""
    config = mlp_config(tmp_path, budget_bytes=1 << 30)
    raised = ranks.run(run_rank_planning_fails_on, config, 0, timeout_s=60)
    assert raised[0] == ("InfeasibleBudgetError", "injected: no plan fits")
    assert raised[1] == ("InfeasibleBudgetError", "rank 0 could not plan: injected: no plan fits")
    # a failure injected where no plan is made changes nothing: rank 1 applies rank 0's plan
    assert ranks.run(run_rank_planning_fails_on, config, 1, timeout_s=60) == [("", "")] * 2


def test_torchrun_command_passes_multi_node_flags_through(tmp_path: Path) -> None:
    from superneurons.errors import ConfigError
    from superneurons.train.launch import Launch, torchrun_command

    single = torchrun_command(Launch(nproc=2), tmp_path / "config.json")
    assert single[single.index("--nproc-per-node") + 1] == "2"
    assert single[single.index("--rdzv-backend") + 1] == "c10d"
    assert single[-3:] == ["-m", "superneurons.commands.rank", str(tmp_path / "config.json")]
    multi = torchrun_command(
        Launch(nproc=4, nnodes=2, node_rank=1, rdzv_endpoint="head:29400"), tmp_path / "c.json"
    )
    for flag, value in [("--nnodes", "2"), ("--node-rank", "1"), ("--rdzv-endpoint", "head:29400")]:
        assert multi[multi.index(flag) + 1] == value
    static = torchrun_command(Launch(nnodes=2, master_addr="10.0.0.1"), tmp_path / "c.json")
    assert static[static.index("--master-addr") + 1] == "10.0.0.1"
    with pytest.raises(ConfigError, match="--rdzv-endpoint"):
        Launch(nnodes=2)


def test_torchrun_leaves_no_log_folder_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun's agent makes a ``torchelastic_*`` folder in the temporary directory per launch
    and never removes it: the launcher gives it a folder of its own and removes that."""
    from superneurons.train import launch

    seen: list[tuple[Path, bool]] = []

    def fake_agent(arguments: list[str]) -> int:
        log_dir = Path(arguments[arguments.index("--log-dir") + 1])
        seen.append((log_dir, log_dir.is_dir()))
        return 3

    monkeypatch.setattr(launch, "_run_agent", fake_agent)
    assert launch.run_torchrun(launch.Launch(nproc=2), tmp_path / "config.json") == 3
    [(log_dir, existed)] = seen
    assert existed and not log_dir.exists()


def test_the_agent_runs_in_the_launcher_and_leaves_its_signals_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun's agent runs in the launcher's process (no second interpreter importing torch):
    the handlers it installs for its death signals, the environment it sets and the Python
    random numbers it draws end with the launch; a failed rank's status comes back; Ctrl-C
    stays a KeyboardInterrupt."""
    import random
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from torch.distributed.launcher import api

    from superneurons.train import launch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE", raising=False)
    before = signal.getsignal(signal.SIGINT)
    random_state = random.getstate()
    seen: list[tuple[str | None, int, list[str]]] = []

    def fake_launch(config: object, entrypoint: object) -> object:
        def run(*args: str) -> None:
            seen.append((os.environ.get("OMP_NUM_THREADS"), config.nproc_per_node, list(args)))
            signal.signal(signal.SIGINT, lambda *_: None)  # as the agent's PContext.start does
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM"  # as launch_agent does
            random.uniform(0.0, 0.3)  # as the rendezvous's delays do
            outcome = outcomes.pop(0)
            if outcome is not None:
                raise outcome

        return run

    failure = ProcessFailure(local_rank=1, pid=1, exitcode=7, error_file="")
    outcomes: list[BaseException | None] = [
        None,
        ChildFailedError("superneurons.commands.rank", {1: failure}),
        SignalException("stopped", signal.SIGTERM),
        SignalException("stopped", signal.SIGINT),
    ]
    monkeypatch.setattr(api, "elastic_launch", fake_launch)
    config_path = tmp_path / "config.json"
    assert launch.run_torchrun(launch.Launch(nproc=2), config_path) == 0
    assert seen == [("1", 2, ["-u", "-m", "superneurons.commands.rank", str(config_path)])]
    assert launch.run_torchrun(launch.Launch(nproc=2), config_path) == 7
    assert launch.run_torchrun(launch.Launch(nproc=2), config_path) == 128 + signal.SIGTERM
    with pytest.raises(KeyboardInterrupt):
        launch.run_torchrun(launch.Launch(nproc=2), config_path)
    assert signal.getsignal(signal.SIGINT) is before
    assert "OMP_NUM_THREADS" not in os.environ
    assert "TORCHELASTIC_SIGNALS_TO_HANDLE" not in os.environ
    assert random.getstate() == random_state


def test_checkpoint_rotation_keeps_the_last_complete_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dataclasses import asdict

    from superneurons.models import build_model
    from superneurons.train import checkpoint
    from superneurons.train.checkpoint import find_resume_point, previous_checkpoint_path

    model = build_model("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = asdict(mlp_config(tmp_path))

    def save(step: int) -> None:
        checkpoint.save_checkpoint(
            tmp_path,
            0,
            epoch=step,
            step=step,
            model=model,
            optimizer=optimizer,
            compression={},
            config=config,
            world_size=1,
        )

    def resume_step() -> int:
        return find_resume_point(tmp_path, config=config, world_size=1).step

    newest, previous = checkpoint_path(tmp_path, 0), previous_checkpoint_path(tmp_path, 0)
    save(1)
    save(2)
    assert resume_step() == 2 and torch.load(previous, weights_only=True)["step"] == 1
    newest.write_bytes(newest.read_bytes()[:100])  # the newest file cut short
    assert resume_step() == 1
    save(3)  # the damaged file is not kept as the previous one
    assert torch.load(previous, weights_only=True)["step"] == 1 and resume_step() == 3

    def crash(src: Any, dst: Any) -> None:
        raise KeyboardInterrupt("killed between the temporary file and the rename")

    monkeypatch.setattr(checkpoint.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        save(4)
    monkeypatch.undo()
    assert Path(f"{newest}.tmp").exists() and resume_step() == 3
    save(5)  # the leftover temporary file is simply overwritten
    assert resume_step() == 5 and not Path(f"{newest}.tmp").exists()


def _logged(out: Path, key: str) -> list[float]:
    """``key`` of every step line of ``out``'s metrics.jsonl."""
    lines = (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
    return [row[key] for row in lines if row.get("kind") == "step"]


def _host_floor_bytes(optimizer: str) -> tuple[int, dict[str, int]]:
    """The smallest budget ``superneurons train`` meets for the MLP at batch 16, and every
    strategy's floor (the optimizer's state counted)."""
    from superneurons.memory import min_peak_bytes, profile_step
    from superneurons.models import build_model, default_loss
    from superneurons.train.sync import build_optimizer

    torch.manual_seed(0)
    model = build_model("mlp")
    config = mlp_config(Path("."), optimizer=optimizer)
    batch = (torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,)))
    profile = profile_step(
        model, *batch, default_loss("mlp"), build_optimizer(config, list(model.parameters()))
    )
    floors = min_peak_bytes(profile)
    return floors["offload+host-optimizer"], floors


@needs_data
@pytest.mark.dist
@pytest.mark.slow
def test_budget_only_the_host_optimizer_meets_trains_and_resumes_exactly(
    ranks: Ranks, tmp_path: Path
) -> None:
    budget, floors = _host_floor_bytes("sgd")
    device_floors = [v for k, v in floors.items() if k in ("recompute", "offload", "checkpoint")]
    assert budget < min(device_floors)  # nothing that steps on the device fits
    # clipped by the global norm: on the device, and on the host where the step waits for it
    common = {"optimizer": "sgd", "compress": "torch-fp16", "max_grad_norm": 0.5}
    plain, straight, split = tmp_path / "plain", tmp_path / "straight", tmp_path / "split"
    ranks.run(run_rank, mlp_config(plain, epochs=2, **common), timeout_s=120)
    ranks.run(
        run_rank, mlp_config(straight, epochs=2, budget_bytes=budget, **common), timeout_s=120
    )
    ranks.run(run_rank, mlp_config(split, epochs=1, budget_bytes=budget, **common), timeout_s=120)
    resumed = mlp_config(split, epochs=2, budget_bytes=budget, resume=True, **common)
    ranks.run(run_rank, resumed, timeout_s=120)
    for rank in range(2):
        p, a, b = (load_checkpoint(d, rank) for d in (plain, straight, split))
        assert "masters" in a["optimizer"]  # the host optimizer's state, fp32 masters included
        for key in ("model", "optimizer", "compression", "rng"):
            _assert_same(a[key], b[key], f"rank{rank}.{key}")
        for name, value in p["model"].items():  # the same SGD, stepped on the host per bucket
            torch.testing.assert_close(a["model"][name], value, rtol=1e-6, atol=1e-7)
    norms = {d: _logged(d, "grad_norm") for d in (plain, straight)}
    assert max(norms[plain]) > 0.5  # clipping acts
    torch.testing.assert_close(norms[straight], norms[plain], rtol=1e-6, atol=0)
