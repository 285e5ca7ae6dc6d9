"""DiLoCo (``train --sync diloco[...]``): the spec, the outer step, its wire, and exact resume.

The distributed properties run on one shared group of 2 gloo ranks:

* H = 1 with a dense outer step (lr 1, no momentum) and a linear inner optimizer is DDP;
* the outer gradient through a lossy codec (summable, gathered, stochastic) leaves every rank
  with bitwise the same parameters, and each rank's bytes are the codec's payload formula;
* the outer gradient through the two-phase all-reduce (error feedback at worker and owner);
* a LocalSGD stopped mid-window and rebuilt from its state_dict continues bitwise, and so
  does ``superneurons train`` resumed from its checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed import Ranks, shared_ranks
from superneurons.cli import main
from superneurons.codecs.feedback import ErrorFeedback
from superneurons.codecs.qsgd import QSGDCodec
from superneurons.codecs.sparse.compacttopk import CompactTopKCodec
from superneurons.codecs.twophase import TwoPhase
from superneurons.errors import ConfigError
from superneurons.localsgd import attach_local_sgd
from superneurons.models import build_model
from superneurons.schemes.diloco import DiLoCo, EveryStep
from superneurons.schemes.grammar import parse_spec, parse_sync
from superneurons.train.checkpoint import save_checkpoint
from superneurons.train.config import TrainConfig
from tiny_data import write_fashion_mnist
from train_support import load_checkpoint, mlp_config, needs_data, run_rank

# -- the spec ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("every-step", EveryStep()),
        ("diloco:steps=50", DiLoCo(steps=50)),
        ("diloco:steps=1,lr=1,momentum=0", DiLoCo(steps=1, outer_lr=1.0, outer_momentum=0.0)),
        ("diloco[steps=8,nesterov=false]:fp16", DiLoCo(parse_spec("fp16"), 8, nesterov=False)),
        ("diloco[steps=4]:ef(qsgd)", DiLoCo(ErrorFeedback(QSGDCodec()), steps=4)),
        ("diloco[steps=4]:twophase:bits=4", DiLoCo(TwoPhase(bits=4), steps=4)),
    ],
)
def test_sync_specs_parse_to_objects_whose_canonical_form_parses_back(
    text: str, expected: Any
) -> None:
    parsed = parse_sync(text)
    assert parsed == expected
    assert parse_sync(str(parsed)) == parsed


def test_the_config_composes_error_feedback_into_the_wire() -> None:
    config = TrainConfig(
        model="mlp", data="fashion-mnist", out_dir="x", sync="diloco[steps=4]:qsgd"
    )
    assert config.sync_scheme == DiLoCo(ErrorFeedback(QSGDCodec()), steps=4)
    bare = TrainConfig(
        model="mlp", data="fashion-mnist", out_dir="x", sync="diloco[steps=4]:qsgd",
        error_feedback=False,
    )  # fmt: skip
    assert bare.sync_scheme == DiLoCo(QSGDCodec(), steps=4)


BAD_SYNC = {
    "diloco:steps=0": "steps",
    "diloco:stepz=5": "'stepz'",
    "diloco:steps=five": "steps='five'",
    "diloco:momentum=1": "momentum",
    "diloco[steps=5]:powersgd:rank=2": "not powersgd",
    "diloco[steps=5]": "malformed",
    "locals": "'locals'",
}


@pytest.mark.parametrize("text", list(BAD_SYNC))
def test_bad_sync_specs_are_one_line_exit_2(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_fashion_mnist(tmp_path / "data")
    argv = ["train", "--model", "mlp", "--data", "fashion-mnist", "--data-dir", str(data)]
    assert main([*argv, "--out", str(tmp_path / "out"), "--sync", text]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("superneurons: error: "), err
    assert BAD_SYNC[text] in err, err


def test_diloco_with_compress_or_another_runs_checkpoint_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, out = write_fashion_mnist(tmp_path / "data"), tmp_path / "out"
    argv = ["train", "--model", "mlp", "--data", "fashion-mnist", "--data-dir", str(data)]
    argv += ["--out", str(out), "--sync", "diloco:steps=2"]
    assert main([*argv, "--compress", "fp16"]) == 2
    assert "drop --compress" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="drop --compress"):
        TrainConfig(model="mlp", data="fashion-mnist", out_dir="x", sync="diloco", warmup_steps=3)
    model = nn.Linear(2, 2)
    every_step = TrainConfig(model="mlp", data="fashion-mnist", out_dir=str(out))
    save_checkpoint(
        out,
        0,
        epoch=1,
        step=1,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        compression={},
        config={k: v for k, v in asdict(every_step).items() if k != "sync"},  # an older run's
        world_size=1,
    )
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sync: 'every-step' -> 'diloco:steps=2'" in err, err


# -- on 2 ranks ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks() -> Ranks:
    return shared_ranks(2)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 5))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)  # each rank its own shard
    return torch.randn(8, 12, generator=gen), torch.randint(0, 5, (8,), generator=gen)


def _train(ddp: Any, optimizer: Any, local: Any, steps: range, rank: int) -> None:
    for step in steps:
        inputs, targets = _batch(rank, step)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(inputs), targets).backward()
        optimizer.step()
        if local is not None:
            local.step()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _h1_is_ddp(rank: int, world_size: int) -> dict[str, Any]:
    """Plain DDP with SGD (momentum 0.9, weight decay) vs DiLoCo H=1, lr 1, no momentum."""
    results = {}
    for name in ("ddp", "diloco", "local-only"):
        model = _model()
        ddp = DistributedDataParallel(model)
        local = None
        if name == "diloco":
            config = DiLoCo(steps=1, outer_lr=1.0, outer_momentum=0.0)
            local = attach_local_sgd(ddp, config)
        elif name == "local-only":  # no averaging at all: shows the data differs by rank
            from superneurons.ddp.local import register_local_gradients

            register_local_gradients(ddp)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        _train(ddp, sgd, local, range(6), rank)
        results[name] = _params(model)
    return results


@pytest.mark.dist
def test_h1_with_a_dense_outer_step_is_ddp(ranks: Ranks) -> None:
    """Equal up to float rounding, not bitwise: the outer gradient is a difference of
    parameters (θ − θ_r, rounded to θ's ulp), where DDP averages the gradients themselves;
    after 6 steps the difference stays within a few ulps of parameters of size ~0.3."""
    results = ranks.run(_h1_is_ddp)
    for mine in results:
        for ddp, diloco, alone in zip(mine["ddp"], mine["diloco"], mine["local-only"], strict=True):
            torch.testing.assert_close(diloco, ddp, rtol=0, atol=2e-7)
            assert (alone - ddp).abs().max() > 1e-3  # without the outer step it is not DDP
    for a, b in zip(results[0]["diloco"], results[1]["diloco"], strict=True):
        assert torch.equal(a, b)  # one model on every rank


WIRES = {
    "fp16 (summable, all-reduce)": parse_spec("fp16"),
    "qsgd (stochastic, gathered)": ErrorFeedback(QSGDCodec()),
    "ctopk (sparse, gathered)": ErrorFeedback(CompactTopKCodec()),
}


def _lossy_wires(rank: int, world_size: int) -> dict[str, Any]:
    out = {}
    for label, wire in WIRES.items():
        model = _model()
        ddp = DistributedDataParallel(model)
        local = attach_local_sgd(ddp, DiLoCo(wire, steps=2), seed=3)
        adam = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _train(ddp, adam, local, range(7), rank)  # rounds after steps 2, 4, 6; one step past
        with local.synced_weights():
            synced = _params(model)
        out[label] = {
            "synced": synced,
            "residuals": dict(local.wire.residuals),
            "bytes": local.bytes_sent_total,
            "rounds": local.rounds,
            "numels": [p.numel() for p in model.parameters()],
        }
    return out


@pytest.mark.dist
def test_a_lossy_wire_leaves_every_rank_with_the_same_model(ranks: Ranks) -> None:
    results = ranks.run(_lossy_wires)
    for label, wire in WIRES.items():
        a, b = results[0][label], results[1][label]
        for x, y in zip(a["synced"], b["synced"], strict=True):
            assert torch.equal(x, y), label
        codec = wire.inner if isinstance(wire, ErrorFeedback) else wire
        assert a["rounds"] == 3
        assert a["bytes"] == 3 * sum(codec.payload_bytes(n) for n in a["numels"]), label
        if isinstance(wire, ErrorFeedback):  # each rank keeps what its codec dropped
            assert a["residuals"].keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
            assert not torch.equal(a["residuals"]["0.weight"], b["residuals"]["0.weight"])


def _twophase_wire(rank: int, world_size: int) -> dict[str, Any]:
    model = _model()
    ddp = DistributedDataParallel(model)
    config = TwoPhase(bits=4, chunk=64, rounding="stochastic", transform="hadamard")
    local = attach_local_sgd(ddp, DiLoCo(ErrorFeedback(config), steps=2), seed=3)
    adam = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(ddp, adam, local, range(7), rank)  # rounds after steps 2, 4, 6; one step past
    with local.synced_weights():
        synced = _params(model)
    twophase = local.wire.twophase
    return {
        "synced": synced,
        "bytes": local.bytes_sent_total,
        "rounds": local.rounds,
        "numels": [p.numel() for p in model.parameters()],
        "worker": set(twophase.worker),
        "owner": set(twophase.owner),
        "config": config,
    }


@pytest.mark.dist
def test_the_twophase_wire_averages_with_feedback_at_both_stages(ranks: Ranks) -> None:
    """The outer gradient through the two-phase all-reduce: one model on every rank, bytes
    per round = P segments (all-to-all) + one (all-gather) of the payload formula."""
    a, b = ranks.run(_twophase_wire)
    for x, y in zip(a["synced"], b["synced"], strict=True):
        assert torch.equal(x, y)
    assert a["rounds"] == 3
    config, world = a["config"], 2
    assert a["bytes"] == 3 * (world + 1) * config.message_bytes(a["numels"], world)
    names = {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert a["worker"] == a["owner"] == b["worker"] == names


def _resume_mid_window(rank: int, world_size: int, tmp: str, wire: str = "qsgd") -> dict[str, Any]:
    config = DiLoCo(ErrorFeedback(parse_spec(wire)), steps=3)

    def build() -> tuple[nn.Module, Any, Any, Any]:
        model = _model()
        ddp = DistributedDataParallel(model)
        local = attach_local_sgd(ddp, config, seed=1)
        return model, ddp, torch.optim.AdamW(model.parameters(), lr=1e-2), local

    model, ddp, adam, local = build()
    _train(ddp, adam, local, range(8), rank)  # rounds after 3 and 6, two steps into the third
    straight = {"model": model.state_dict(), "adam": adam.state_dict(), "local": local.state_dict()}
    model, ddp, adam, local = build()
    _train(ddp, adam, local, range(4), rank)  # stopped one step into the second window
    path = Path(tmp) / f"{wire}-rank{rank}.pt"
    torch.save(
        {"model": model.state_dict(), "adam": adam.state_dict(), "local": local.state_dict()}, path
    )
    model, ddp, adam, local = build()
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    adam.load_state_dict(saved["adam"])
    local.load_state_dict(saved["local"])
    assert local.inner_steps == 1
    _train(ddp, adam, local, range(4, 8), rank)
    resumed = {"model": model.state_dict(), "adam": adam.state_dict(), "local": local.state_dict()}
    return {"straight": straight, "resumed": resumed}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.dist
@pytest.mark.parametrize("wire", ["qsgd", "twophase:bits=2,chunk=64,rounding=stochastic"])
def test_local_sgd_resumes_mid_window_bitwise(ranks: Ranks, tmp_path: Path, wire: str) -> None:
    for result in ranks.run(_resume_mid_window, str(tmp_path), wire):
        for key in ("model", "adam", "local"):
            assert _same(result["straight"][key], result["resumed"][key]), key
        assert result["straight"]["local"]["inner_steps"] == 2


@needs_data
@pytest.mark.dist
def test_train_resumes_bitwise_and_counts_the_outer_bytes(ranks: Ranks, tmp_path: Path) -> None:
    sync = "diloco[steps=2]:qsgd"  # 3 steps per epoch: rounds after steps 2, 3 (epoch end), 5, 6
    straight, split = tmp_path / "straight", tmp_path / "split"
    options = {"sync": sync, "optimizer": "adamw"}
    (summary, _) = ranks.run(run_rank, mlp_config(straight, epochs=2, **options), timeout_s=120)
    ranks.run(run_rank, mlp_config(split, epochs=1, **options), timeout_s=120)
    ranks.run(run_rank, mlp_config(split, epochs=2, resume=True, **options), timeout_s=120)
    for rank in range(2):
        a, b = load_checkpoint(straight, rank), load_checkpoint(split, rank)
        assert a["step"] == b["step"] == 6
        for key in ("model", "optimizer", "compression", "rng"):
            assert _same(a[key], b[key]), f"rank{rank}.{key}"
    models = [load_checkpoint(straight, r)["model"] for r in range(2)]
    assert _same(*models)  # every epoch ends synchronised
    assert summary["sync"] == summary["compression"] == str(parse_sync("diloco[steps=2]:ef(qsgd)"))
    assert summary["sync_rounds"] == 4
    qsgd = QSGDCodec()
    sizes = [p.numel() for p in build_model("mlp").parameters()]
    assert summary["bytes_per_step"] * 6 == 4 * sum(qsgd.payload_bytes(n) for n in sizes)
    assert json.loads((straight / "summary.json").read_text())["sync_rounds"] == 4
