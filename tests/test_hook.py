"""The compressed DDP comm hook on 2 gloo ranks: exactness, consistency, many buckets, NaN."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed import Ranks, shared_ranks
from superneurons.codecs.cast import Fp16Codec, IdentityCodec
from superneurons.codecs.qsgd import QSGDCodec
from superneurons.codecs.sparse.topk import TopKCodec

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def ranks() -> Ranks:
    """One 2-rank gloo group shared by the test modules (starting ranks costs seconds)."""
    return shared_ranks(2)


# Tiny buckets: every parameter gets its own bucket, so multi-bucket ordering is exercised.
_TINY_BUCKET_MB = 0.0001


class _Net(nn.Module):
    """Conv (4-D weight) + several linears: PowerSGD sees matrices, tensors and biases."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 6, 3)
        self.fc1 = nn.Linear(6 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 32)
        self.out = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).flatten(1)  # (B, 96)
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(h)))))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 2, 6, 6, generator=gen), torch.randint(0, 5, (8,), generator=gen)


def _ddp(bucket_cap_mb: float = 25.0) -> DistributedDataParallel:
    torch.manual_seed(0)
    return DistributedDataParallel(_Net(), bucket_cap_mb=bucket_cap_mb)


def _train(model: DistributedDataParallel, rank: int, steps: int, start: int = 0) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(start, start + steps):
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _params(model: DistributedDataParallel) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _identity_vs_plain(rank: int, world_size: int) -> tuple[list[torch.Tensor], ...]:
    from superneurons.ddp.hook import register_compression

    plain = _ddp(_TINY_BUCKET_MB)
    hooked = _ddp(_TINY_BUCKET_MB)
    state = register_compression(hooked, IdentityCodec())
    _train(plain, rank, 4)
    _train(hooked, rank, 4)
    assert state.step == 4 and state.bytes_sent_step == state.dense_bytes_step
    # dense warm-up: the first steps of a lossy codec are plain averaging
    plain_short, warm = _ddp(_TINY_BUCKET_MB), _ddp(_TINY_BUCKET_MB)
    warm_state = register_compression(warm, "warmup(steps=2,fft:theta=0.9,bits=8)")
    _train(plain_short, rank, 2)
    _train(warm, rank, 2)
    assert warm_state.step == 2 and not warm_state.residuals
    return _params(plain) + _params(plain_short), _params(hooked) + _params(warm)


def test_identity_and_dense_warmup_equal_plain_ddp_bitwise(ranks: Ranks) -> None:
    for plain, hooked in ranks.run(_identity_vs_plain):
        for a, b in zip(plain, hooked, strict=True):
            assert torch.equal(a, b)


def _sparsifiers_keeping_everything_vs_plain(
    rank: int, world_size: int
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    from superneurons.ddp.hook import register_compression

    plain = _ddp(_TINY_BUCKET_MB)
    _train(plain, rank, 3)
    out = []
    # every value kept at fp32: the gathered route, its sparse decode into the bucket and its
    # sparse error feedback must then average exactly as DDP (two ranks: x / 2 is exact)
    for spec in ("ctopk:theta=0.0,bits=32", "topk:ratio=1.0"):
        hooked = _ddp(_TINY_BUCKET_MB)
        register_compression(hooked, spec)
        _train(hooked, rank, 3)
        out.append((_params(plain), _params(hooked)))
    return out


def test_lossless_sparsifiers_equal_plain_ddp_bitwise(ranks: Ranks) -> None:
    for pairs in ranks.run(_sparsifiers_keeping_everything_vs_plain):
        for plain, hooked in pairs:
            for a, b in zip(plain, hooked, strict=True):
                assert torch.equal(a, b)


_LOSSY: list[Any] = [
    TopKCodec(ratio=0.1),
    QSGDCodec(),
    Fp16Codec(),
    "powersgd:rank=2",
    "torch-fp16",
    "fft:theta=0.9,bits=8",
    "rangefloat:bits=8",
    "terngrad",
    "signsgd",
    "bf16",
]


def _lossy_runs(rank: int, world_size: int) -> list[tuple[str, list[torch.Tensor], int, int]]:
    from superneurons.compress import Warmup, parse_spec
    from superneurons.ddp.hook import register_compression
    from superneurons.schemes.compose import with_defaults

    out = []
    for codec in _LOSSY:
        model = _ddp(_TINY_BUCKET_MB)
        base = parse_spec(codec) if isinstance(codec, str) else codec
        state = register_compression(model, with_defaults(Warmup(base, steps=1)))
        for _ in range(2):  # repeated runs over many buckets: no collective mismatch
            _train(model, rank, 3, start=state.step)
        out.append((state.spec, _params(model), state.bytes_sent_step, state.dense_bytes_step))
    return out


def test_lossy_codecs_keep_ranks_identical_over_many_buckets(ranks: Ranks) -> None:
    rank0, rank1 = ranks.run(_lossy_runs, timeout_s=120)
    torch.manual_seed(0)
    reference = [p.detach() for p in _Net().parameters()]
    for (spec, params0, sent, dense), (_, params1, _, _) in zip(rank0, rank1, strict=True):
        for a, b in zip(params0, params1, strict=True):
            assert torch.equal(a, b), spec
        assert any(not torch.equal(a, r) for a, r in zip(params0, reference, strict=True)), spec
        assert 0 < sent < dense, spec


def _resume(rank: int, world_size: int, spec: str) -> tuple[list[torch.Tensor], ...]:
    from superneurons.ddp.hook import register_compression

    def fresh() -> tuple[DistributedDataParallel, Any, torch.optim.Optimizer]:
        model = _ddp(_TINY_BUCKET_MB)
        state = register_compression(model, spec, seed=3)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def run(model: Any, state: Any, opt: torch.optim.Optimizer, steps: int) -> None:
        for _ in range(steps):
            x, y = _batch(rank, state.step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    model, state, opt = fresh()
    run(model, state, opt, 6)
    straight = _params(model)
    straight_residuals = [state.residuals[k] for k in sorted(state.residuals)]

    model, state, opt = fresh()
    run(model, state, opt, 3)
    saved = {
        "model": {k: v.clone() for k, v in model.module.state_dict().items()},
        "opt": opt.state_dict(),
        "compression": state.state_dict(),
    }
    model, state, opt = fresh()
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["compression"])
    run(model, state, opt, 3)
    resumed_residuals = [state.residuals[k] for k in sorted(state.residuals)]
    return straight, _params(model), straight_residuals, resumed_residuals


@pytest.mark.parametrize("spec", ["qsgd", "powersgd:rank=2"])
def test_save_resume_continues_exactly(ranks: Ranks, spec: str) -> None:
    for straight, resumed, res_a, res_b in ranks.run(_resume, spec):
        assert len(res_a) == len(res_b) > 0
        for a, b in zip(straight + res_a, resumed + res_b, strict=True):
            assert torch.equal(a, b)


def _mismatch(rank: int, world_size: int) -> tuple[str, float]:
    from superneurons.ddp.hook import register_compression
    from superneurons.errors import ConfigError

    model = _ddp()
    start = time.monotonic()
    try:
        register_compression(model, TopKCodec(ratio=0.1 if rank == 0 else 0.2))
    except ConfigError as exc:
        return str(exc), time.monotonic() - start
    return "", time.monotonic() - start


def test_mismatched_settings_fail_fast_on_every_rank(ranks: Ranks) -> None:
    for message, elapsed_s in ranks.run(_mismatch, timeout_s=30):
        assert "configured differently" in message and "ratio=0.2" in message
        assert elapsed_s < 5.0


def _nan_policy(rank: int, world_size: int) -> list[tuple[str, bool, bool, bool, bool]]:
    from superneurons.ddp.hook import register_compression

    out = []
    for codec in [TopKCodec(ratio=0.1), QSGDCodec(), Fp16Codec(), "powersgd:rank=2", "fft"]:
        model = _ddp()  # one bucket: the poisoned parameter shares it with all others
        state = register_compression(model, codec)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        poison = {"on": False}

        def add_nan(grad: torch.Tensor, poison: dict[str, bool] = poison) -> torch.Tensor:
            if poison["on"] and rank == 1:
                grad = grad.clone()
                grad.view(-1)[0] = float("nan")
            return grad

        model.module.fc1.weight.register_hook(add_nan)
        for step in range(3):
            poison["on"] = step == 1
            x, y = _batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            if step == 1:
                nonfinite_everywhere = not grads_finite
            else:
                assert grads_finite
            if grads_finite:  # what GradScaler does: skip the step on non-finite grads
                opt.step()
        residuals_finite = all(bool(torch.isfinite(r).all()) for r in state.residuals.values())
        q_finite = state.powersgd is None or all(
            bool(torch.isfinite(q).all()) for q in state.powersgd.q_by_name.values()
        )
        params_finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        out.append((state.spec, nonfinite_everywhere, residuals_finite, q_finite, params_finite))
    return out


def test_nan_gradient_is_nonfinite_on_all_ranks_and_state_stays_clean(ranks: Ranks) -> None:
    for results in ranks.run(_nan_policy):
        for spec, nonfinite_everywhere, residuals_finite, q_finite, params_finite in results:
            assert nonfinite_everywhere, spec
            assert residuals_finite and q_finite and params_finite, spec


def _theta_runs(rank: int, world_size: int) -> list[tuple[list[torch.Tensor], float | None]]:
    from superneurons.codecs.schedule import DiminishingTheta, ErrorBudgetTheta
    from superneurons.compress import ErrorFeedback, Scheduled, parse_spec
    from superneurons.ddp.hook import register_compression

    out = []
    for schedule in [DiminishingTheta(start=0.99, floor=0.9, steps=4), ErrorBudgetTheta(0.3)]:
        model = _ddp(_TINY_BUCKET_MB)
        fft = parse_spec("fft:theta=0.9,bits=8")
        state = register_compression(model, ErrorFeedback(Scheduled(fft, schedule)))
        _train(model, rank, 5)
        out.append((_params(model), state.last_theta))
    return out


def test_theta_schedules_agree_across_ranks(ranks: Ranks) -> None:
    """θ advances per step (diminishing) or is agreed by all-reduce MIN (error budget), so
    payload sizes match and the ranks stay identical."""
    rank0, rank1 = ranks.run(_theta_runs)
    (diminishing0, theta_d0), (budget0, theta_b0) = rank0
    (diminishing1, theta_d1), (budget1, theta_b1) = rank1
    assert theta_d0 == theta_d1 == 0.9  # step 4 of a 4-step schedule: the floor
    assert theta_b0 == theta_b1 is not None
    for a, b in zip(diminishing0 + budget0, diminishing1 + budget1, strict=True):
        assert torch.equal(a, b)


def _bad_schedule(rank: int, world_size: int) -> str:
    from superneurons.codecs.schedule import ConstantTheta
    from superneurons.compress import QSGDCodec, Scheduled
    from superneurons.ddp.hook import register_compression
    from superneurons.errors import ConfigError

    try:
        register_compression(_ddp(), Scheduled(QSGDCodec(), ConstantTheta(0.9)))
    except ConfigError as exc:
        return str(exc)
    return ""


def test_theta_schedule_on_a_codec_without_theta_is_rejected(ranks: Ranks) -> None:
    for message in ranks.run(_bad_schedule):
        assert "no θ" in message


def _residual_storages(rank: int, world_size: int) -> dict[str, int]:
    """Distinct residual storages per spec over 5 steps after the first (one bucket)."""
    from superneurons.ddp.hook import register_compression

    out = {}
    for spec in ["fp16", "powersgd:rank=2"]:
        model = _ddp()
        state = register_compression(model, spec)
        _train(model, rank, 1)
        pointers = set()
        for step in range(1, 6):
            _train(model, rank, 1, start=step)
            pointers |= {r.untyped_storage().data_ptr() for r in state.residuals.values()}
        out[spec] = len(pointers)
    return out


def test_error_feedback_reuses_its_storage(ranks: Ranks) -> None:
    """Hook overhead: fp16's residuals alternate between two kept slabs, PowerSGD's
    are rewritten in place, so no step allocates gradient-sized residuals."""
    for counts in ranks.run(_residual_storages):
        assert counts["fp16"] <= 2, counts
        # PowerSGD: one storage per compressed matrix (conv, fc1, fc2, out), kept throughout
        assert counts["powersgd:rank=2"] == 4, counts
