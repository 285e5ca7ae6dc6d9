"""CompressedAdamW: AdamW with compressed, error-fed update averaging."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from distributed import shared_ranks
from superneurons.compress import parse_spec
from superneurons.ddp.local import register_local_gradients
from superneurons.errors import ConfigError
from superneurons.optim.adam import CompressedAdamW
from superneurons.schemes.adam import AdamMomentum, AdamUpdate
from superneurons.schemes.grammar import parse_scheme


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 12, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int = 0) -> None:
    for step in steps:
        x, y = _batch(step, rank)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


KWARGS = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}


@pytest.mark.parametrize(
    "options",
    [{"mode": "update"}, {"mode": "momentum", "warmup_steps": 6}],
    ids=["update", "momentum-all-warmup"],
)
def test_lossless_on_one_process_is_adamw(options: dict) -> None:
    ours, ref = _model(), _model()
    opt = CompressedAdamW(ours.parameters(), codec=parse_spec("identity"), **options, **KWARGS)
    _train(ours, opt, range(6))
    _train(ref, torch.optim.AdamW(ref.parameters(), foreach=False, **KWARGS), range(6))
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert opt.bytes_sent_total == opt.dense_bytes_total  # fp32 on the wire


def test_momentum_mode_freezes_the_second_moment_after_warmup() -> None:
    model = _model()
    opt = CompressedAdamW(
        model.parameters(), codec=parse_spec("identity"), warmup_steps=2, **KWARGS
    )
    _train(model, opt, range(2))
    frozen = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    momentum = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    _train(model, opt, range(2, 3))
    for p, v, m in zip(model.parameters(), frozen, momentum, strict=True):
        assert torch.equal(opt.state[p]["exp_avg_sq"], v)
        # lossless codec on one rank: the momentum is AdamW's (lerp towards the gradient)
        assert p.grad is not None
        torch.testing.assert_close(opt.state[p]["exp_avg"], torch.lerp(m, p.grad, 0.1))


def test_clip_rms_bounds_the_frozen_direction() -> None:
    model = _model()
    opt = CompressedAdamW(
        model.parameters(), codec=parse_spec("identity"), warmup_steps=1, clip_rms=0.5, lr=1.0
    )
    _train(model, opt, range(1))
    before = [p.detach().clone() for p in model.parameters()]
    for group in opt.param_groups:
        group["weight_decay"] = 0.0
    _train(model, opt, range(1, 2))
    for p, old in zip(model.parameters(), before, strict=True):
        step_rms = float((p.detach() - old).square().mean().sqrt())
        assert step_rms <= 0.5 + 1e-6


def test_fp16_warmup_wire_halves_the_bytes() -> None:
    model = _model()
    opt = CompressedAdamW(
        model.parameters(),
        codec=parse_spec("signsgd"),
        warmup_steps=2,
        warmup_codec=parse_spec("fp16"),
        **KWARGS,
    )
    _train(model, opt, range(2))
    assert opt.bytes_sent_total * 2 == opt.dense_bytes_total


def test_save_resume_continues_bitwise() -> None:
    codec = parse_spec("signsgd")
    model = _model()
    opt = CompressedAdamW(model.parameters(), codec=codec, lr=1e-2, warmup_steps=1)
    _train(model, opt, range(3))  # 1 warm-up step, 2 compressed
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _train(model, opt, range(3, 6))

    resumed = _model()
    resumed.load_state_dict(saved_model)
    opt2 = CompressedAdamW(resumed.parameters(), codec=codec, lr=1e-2, warmup_steps=1)
    opt2.load_state_dict(saved_opt)
    _train(resumed, opt2, range(3, 6))
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt2.bytes_sent_total == opt.bytes_sent_total
    other = CompressedAdamW(_model().parameters(), codec=parse_spec("fp16"), warmup_steps=1)
    with pytest.raises(ConfigError, match="codec"):
        other.load_state_dict(saved_opt)


def test_bytes_are_the_codecs_payload() -> None:
    codec = parse_spec("signsgd")
    model = _model()
    opt = CompressedAdamW(model.parameters(), codec=codec, mode="update", lr=1e-2)
    _train(model, opt, range(1))
    assert opt.bytes_sent_step == sum(codec.payload_bytes(p.numel()) for p in model.parameters())
    assert opt.dense_bytes_total / opt.bytes_sent_total > 8


def test_bad_options() -> None:
    with pytest.raises(ConfigError):
        CompressedAdamW(_model().parameters(), codec=parse_spec("signsgd"), warmup_steps=-1)
    with pytest.raises(ConfigError, match="warmup_steps >= 1"):
        CompressedAdamW(_model().parameters(), codec=parse_spec("signsgd"))
    with pytest.raises(ConfigError, match="summable"):
        CompressedAdamW(
            _model().parameters(),
            codec=parse_spec("signsgd"),
            warmup_steps=1,
            warmup_codec=parse_spec("topk"),
        )
    with pytest.raises(ConfigError, match="Codec"):
        CompressedAdamW(_model().parameters(), codec="signsgd")  # type: ignore[arg-type]


def test_adam_schemes_are_productions_of_the_one_grammar() -> None:
    spec = parse_scheme("adam-momentum[warmup=20,wire=fp16,clip=1.5]:topk:ratio=0.1", adam=True)
    assert isinstance(spec, AdamMomentum)
    assert (spec.mode, spec.warmup_steps, spec.clip_rms) == ("momentum", 20, 1.5)
    assert spec.inner == parse_spec("topk:ratio=0.1")
    assert spec.wire == parse_spec("fp16")
    assert str(spec) == "adam-momentum[warmup=20,wire=fp16,clip=1.5]:topk:ratio=0.1,select=exact"
    update = parse_scheme("adam-update:signsgd", adam=True)
    assert isinstance(update, AdamUpdate) and update.kwargs()["warmup_codec"] is None
    assert str(update) == "adam-update:signsgd"
    assert parse_scheme("fft", adam=True) == parse_spec("fft")
    with pytest.raises(ConfigError, match="valid: warmup, wire, clip"):
        parse_scheme("adam-momentum[warm=2]:signsgd", adam=True)
    with pytest.raises(ConfigError, match="warmup >= 1"):
        parse_scheme("adam-momentum:signsgd", adam=True)
    with pytest.raises(ConfigError, match="summable"):
        parse_scheme("adam-momentum[warmup=2,wire=topk]:signsgd", adam=True)
    with pytest.raises(ConfigError, match="optimizer scheme"):
        parse_spec("adam-update:signsgd")  # not something the gradient hook takes


def _ddp_run(rank: int, world_size: int, spec: str) -> list[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel

    parsed = parse_scheme(spec, adam=True)
    assert isinstance(parsed, AdamMomentum | AdamUpdate)
    ddp = DistributedDataParallel(_model())
    register_local_gradients(ddp)
    opt = CompressedAdamW(ddp.parameters(), lr=1e-2, **parsed.kwargs())
    _train(ddp, opt, range(4), rank)
    return [p.detach().clone() for p in ddp.parameters()]


@pytest.mark.dist
@pytest.mark.parametrize(
    "spec",
    [
        "adam-momentum[warmup=1,wire=fp16]:signsgd",
        "adam-momentum[warmup=2]:terngrad",
        "adam-update[warmup=1]:signsgd",
        "adam-update:fp16",
        "adam-momentum[warmup=1,wire=fp16]:twophase:bits=1,chunk=8",
    ],
)
def test_two_ranks_stay_identical(spec: str) -> None:
    first, second = shared_ranks(2).run(_ddp_run, spec)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    # and they trained on different data: not the single-process result
    parsed = parse_scheme(spec, adam=True)
    assert isinstance(parsed, AdamMomentum | AdamUpdate)
    single = _model()
    _train(single, CompressedAdamW(single.parameters(), lr=1e-2, **parsed.kwargs()), range(4))
    assert any(not torch.equal(a, b) for a, b in zip(first, single.parameters(), strict=True))


def _twophase_resume(rank: int, world_size: int) -> list[list[torch.Tensor]]:
    """1-bit Adam over the two-phase exchange: 4 steps straight, and 2 + save/load + 2."""
    from torch.nn.parallel import DistributedDataParallel

    parsed = parse_scheme("adam-momentum[warmup=1]:twophase:bits=1,chunk=8", adam=True)
    assert isinstance(parsed, AdamMomentum)
    runs = []
    for resume in (False, True):
        ddp = DistributedDataParallel(_model())
        register_local_gradients(ddp)
        opt = CompressedAdamW(ddp.parameters(), lr=1e-2, **parsed.kwargs())
        _train(ddp, opt, range(2), rank)
        if resume:
            saved = {"model": ddp.module.state_dict(), "opt": opt.state_dict()}
            assert opt.twophase is not None and opt.twophase.worker  # residuals exist
            ddp = DistributedDataParallel(_model())
            register_local_gradients(ddp)
            opt = CompressedAdamW(ddp.parameters(), lr=1e-2, **parsed.kwargs())
            ddp.module.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
        _train(ddp, opt, range(2, 4), rank)
        runs.append([p.detach().clone() for p in ddp.parameters()])
    assert opt.bytes_sent_step > 0
    return runs


@pytest.mark.dist
def test_one_bit_adam_over_the_two_phase_exchange_resumes_bitwise() -> None:
    for straight, resumed in shared_ranks(2).run(_twophase_resume):
        for a, b in zip(straight, resumed, strict=True):
            assert torch.equal(a, b)
