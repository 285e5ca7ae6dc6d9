"""CompressedAdamW: AdamW with compressed, error-fed update averaging."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from distributed import shared_ranks
from superneurons.compress import parse_spec
from superneurons.compress.adam import CompressedAdamW, register_local_gradients
from superneurons.errors import ConfigError


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


def test_identity_codec_on_one_process_is_adamw() -> None:
    ours, ref = _model(), _model()
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    opt = CompressedAdamW(ours.parameters(), codec=parse_spec("identity"), **kwargs)
    _train(ours, opt, range(6))
    _train(ref, torch.optim.AdamW(ref.parameters(), foreach=False, **kwargs), range(6))
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert opt.bytes_sent_total == opt.dense_bytes_total  # fp32 on the wire


def test_save_resume_continues_bitwise() -> None:
    codec = parse_spec("signsgd")
    model = _model()
    opt = CompressedAdamW(model.parameters(), codec=codec, lr=1e-2, warmup_steps=1)
    _train(model, opt, range(3))
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
    with pytest.raises(ConfigError, match="codec"):
        CompressedAdamW(_model().parameters(), codec=parse_spec("fp16")).load_state_dict(saved_opt)


def test_bytes_are_the_codecs_payload() -> None:
    codec = parse_spec("signsgd")
    model = _model()
    opt = CompressedAdamW(model.parameters(), codec=codec, lr=1e-2)
    _train(model, opt, range(1))
    assert opt.bytes_sent_step == sum(codec.payload_bytes(p.numel()) for p in model.parameters())
    assert opt.dense_bytes_total / opt.bytes_sent_total > 8


def test_bad_options() -> None:
    with pytest.raises(ConfigError):
        CompressedAdamW(_model().parameters(), codec=parse_spec("signsgd"), warmup_steps=-1)
    with pytest.raises(ConfigError, match="Codec"):
        CompressedAdamW(_model().parameters(), codec="signsgd")  # type: ignore[arg-type]


def _ddp_run(rank: int, world_size: int, spec: str) -> list[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(_model())
    register_local_gradients(ddp)
    opt = CompressedAdamW(ddp.parameters(), codec=parse_spec(spec), lr=1e-2, warmup_steps=1)
    _train(ddp, opt, range(4), rank)
    return [p.detach().clone() for p in ddp.parameters()]


@pytest.mark.dist
@pytest.mark.parametrize("spec", ["signsgd", "fp16", "terngrad"])
def test_two_ranks_stay_identical(spec: str) -> None:
    first, second = shared_ranks(2).run(_ddp_run, spec)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    # and they trained on different data: not the single-process result
    single = _model()
    _train(single, CompressedAdamW(single.parameters(), codec=parse_spec(spec), lr=1e-2), range(4))
    assert any(not torch.equal(a, b) for a, b in zip(first, single.parameters(), strict=True))
