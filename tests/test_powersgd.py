"""PowerSGD (Vogels et al. NeurIPS'19) on one in-process gloo rank: the algebra, not the wire."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from superneurons.codecs.powersgd import PowerSGD, orthogonalize_, orthogonalize_rows_
from superneurons.ddp.powersgd import PowerSGDState, powersgd_reduce
from superneurons.errors import ConfigError
from superneurons.schemes.anchors import TorchDense, TorchPowerSGD
from superneurons.schemes.grammar import parse_spec


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_orthogonalize_gives_orthonormal_columns() -> None:
    matrix = torch.randn(50, 4)
    q = orthogonalize_(matrix.clone())
    torch.testing.assert_close(q.t() @ q, torch.eye(4), atol=1e-5, rtol=0)


def test_batched_row_orthogonalisation_equals_the_per_matrix_one() -> None:
    """The hook orthogonalises all Pᵀ of one shape in one batched pass: the same as
    Gram-Schmidt on each P's columns, up to float32 rounding (a zero matrix stays finite)."""
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(40, 4, generator=gen) for _ in range(3)] + [torch.zeros(40, 4)]
    rows = torch.stack([p.t() for p in ps]).contiguous()
    orthogonalize_rows_(rows)
    for p, got in zip(ps, rows, strict=True):
        torch.testing.assert_close(got.t(), orthogonalize_(p.clone()), atol=1e-5, rtol=1e-5)
    assert bool(torch.isfinite(rows).all())


def test_which_tensors_are_compressed() -> None:
    config = PowerSGD(rank=4)
    assert config.matrix_shape((10,)) is None  # biases travel dense
    assert config.matrix_shape((4, 4)) is None  # factors not smaller than the matrix
    assert config.matrix_shape((16, 3, 3, 3)) == (16, 27)  # conv weight as a matrix
    assert config.payload_bytes([(64, 32), (32,)]) == (4 * (64 + 32) + 32) * 4


def test_spec_parsing_and_errors() -> None:
    assert parse_spec("powersgd:rank=2") == PowerSGD(rank=2)
    assert parse_spec("torch-powersgd:rank=8") == TorchPowerSGD(rank=8)
    assert isinstance(parse_spec("dense"), TorchDense)
    assert str(parse_spec("powersgd")) == "powersgd:rank=4"
    for bad in ["powersgd:rank=0", "powersgd:r=2", "powersgd:rank=x", "torch-fp16:rank=2", " "]:
        with pytest.raises(ConfigError):
            parse_spec(bad)


def _reduce(
    config: PowerSGD,
    state: PowerSGDState,
    grads: dict[str, torch.Tensor],
    residuals: dict[str, torch.Tensor] | None,
) -> torch.Tensor:
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    pieces, offset = [], 0
    for name, grad in grads.items():
        pieces.append((name, flat[offset : offset + grad.numel()].view(grad.shape)))
        offset += grad.numel()
    out = torch.empty_like(flat)
    fut, sent = powersgd_reduce(
        config, state, pieces, out, residuals=residuals, group=None, world_size=1
    )
    assert sent == config.payload_bytes([g.shape for g in grads.values()])
    return fut.wait()


@pytest.mark.usefixtures("one_rank")
def test_low_rank_gradient_is_reconstructed_exactly() -> None:
    config, state = PowerSGD(rank=3), PowerSGDState()
    low_rank = torch.randn(40, 3) @ torch.randn(3, 30)  # rank 3 = the approximation rank
    bias = torch.randn(40)
    out = _reduce(config, state, {"w": low_rank, "b": bias}, None)
    torch.testing.assert_close(out[: low_rank.numel()].view(40, 30), low_rank, atol=1e-4, rtol=0)
    assert torch.equal(out[low_rank.numel() :], bias)  # 1-D: sent exactly


@pytest.mark.usefixtures("one_rank")
def test_error_feedback_keeps_what_was_dropped() -> None:
    config, state = PowerSGD(rank=1), PowerSGDState()
    grad = torch.randn(20, 10)
    residuals: dict[str, torch.Tensor] = {}
    out = _reduce(config, state, {"w": grad}, residuals)
    # sent + kept = the gradient (one rank: the average is the local approximation)
    torch.testing.assert_close(out.view(20, 10) + residuals["w"].view(20, 10), grad)
    assert "w" in state.q_by_name  # warm start stored


@pytest.mark.usefixtures("one_rank")
def test_warm_start_improves_the_approximation() -> None:
    """Repeated power iterations on a fixed matrix converge to its best rank-r approximation."""
    config, state = PowerSGD(rank=2), PowerSGDState()
    matrix = torch.randn(30, 3) @ torch.diag(torch.tensor([10.0, 5.0, 0.1])) @ torch.randn(3, 20)
    errors = [
        (_reduce(config, state, {"w": matrix}, None).view(30, 20) - matrix).norm() for _ in range(4)
    ]
    assert errors[-1] <= errors[0]
    best = torch.linalg.svd(matrix).S[2]  # Eckart–Young: error of the best rank-2 approximation
    assert errors[-1] < 1.01 * best


def test_state_dict_round_trip() -> None:
    state = PowerSGDState(seed=5)
    q = state.q_for("layer.weight", 7, 2, torch.device("cpu"))
    other = PowerSGDState()
    other.load_state_dict(state.state_dict())
    assert other.seed == 5 and torch.equal(other.q_by_name["layer.weight"], q)
    # the first Q depends only on (seed, name): every rank draws the same matrix
    assert torch.equal(PowerSGDState(seed=5).q_for("layer.weight", 7, 2, torch.device("cpu")), q)


@pytest.mark.usefixtures("one_rank")
def test_in_place_reduction_equals_the_algorithm_written_out() -> None:
    """Algorithm 1 of Vogels et al. with error feedback, step by step, against the hook's
    in-place version (its own products and layouts, so equal up to float32 rounding); the
    residual keeps its storage from the second step on (no gradient-sized allocation)."""
    config, state = PowerSGD(rank=2), PowerSGDState(seed=3)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(24, 3, 2, 2, generator=gen) for _ in range(3)]
    residuals: dict[str, torch.Tensor] = {}
    reference_r = torch.zeros(24, 12)
    q = PowerSGDState(seed=3).q_for("w", 12, 2, torch.device("cpu")).clone()
    pointers = []
    for grad in grads:
        out = _reduce(config, state, {"w": grad.clone()}, residuals)
        m = grad.reshape(24, 12) + reference_r
        p_hat = orthogonalize_(m @ q)
        q = m.t() @ p_hat
        expected = p_hat @ q.t()
        reference_r = m - expected
        torch.testing.assert_close(out.view(24, 12), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(residuals["w"].view(24, 12), reference_r, rtol=1e-5, atol=1e-5)
        pointers.append(residuals["w"].data_ptr())
    assert pointers[1] == pointers[2]
