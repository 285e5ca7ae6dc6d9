"""The LM head + loss in chunks (memory.chunked.headloss): values and gradients equal to the
unchunked reference on PyTorch's chunked op and on the fallback loop, ignored tokens, masked spans,
odd chunk counts, bf16 without fp32 GEMMs, no data-dependent op (it runs on fake tensors), and a
peak a fraction of the unchunked one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from superneurons.errors import ConfigError
from superneurons.memory.chunked import headloss
from superneurons.memory.chunked.headloss import (
    HEAD_MODES,
    MIN_CHUNK_TOKENS,
    chunk_tokens_for,
    linear_cross_entropy,
    resolve_implementation,
)
from superneurons.memory.tracker import LiveStorageTracker

N, H, V = 203, 48, 1000  # 203 tokens in chunks of 64: three full chunks and one of 11
IMPLS = ["native", "pure"] if headloss.native_linear_cross_entropy() is not None else ["pure"]


def _inputs(dtype: torch.dtype = torch.float32, *, bias: bool = False) -> tuple:
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(N, H, generator=gen).to(dtype)
    weight = (0.05 * torch.randn(V, H, generator=gen)).to(dtype)
    b = (0.1 * torch.randn(V, generator=gen)).to(dtype) if bias else None
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[::5] = -100  # scattered ignored tokens
    targets[64:128] = -100  # a whole chunk masked (a prompt, padding)
    return hidden, weight, b, targets


def _grads(loss_of, hidden, weight, bias):  # type: ignore[no-untyped-def]
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias) if t is not None]
    loss = loss_of(*leaves)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


def _reference(hidden, weight, bias, targets, **kw):  # type: ignore[no-untyped-def]
    def loss_of(h, w, b=None):  # type: ignore[no-untyped-def]
        return F.cross_entropy(F.linear(h, w, b).float(), targets, **kw)

    return _grads(loss_of, hidden, weight, bias)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("mode", HEAD_MODES)
@pytest.mark.parametrize("impl", IMPLS)
def test_loss_and_gradients_equal_the_unchunked_reference(impl: str, mode: str, bias: bool) -> None:
    hidden, weight, b, targets = _inputs(bias=bias)
    ref_loss, ref_grads = _reference(hidden, weight, b, targets)

    def loss_of(h, w, bb=None):  # type: ignore[no-untyped-def]
        return linear_cross_entropy(h, w, targets, bias=bb, chunk_tokens=64, mode=mode, impl=impl)

    loss, grads = _grads(loss_of, hidden, weight, b)
    assert loss.dtype == torch.float32
    assert _relative(loss, ref_loss) <= 1e-6
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert _relative(grad, ref) <= 1e-6
    assert grads[0][64:128].abs().max() == 0  # a masked span gets no gradient


@pytest.mark.parametrize("impl", IMPLS)
def test_num_items_and_all_ignored_follow_hugging_face(impl: str) -> None:
    hidden, weight, _, targets = _inputs()
    ref, _ = _reference(hidden, weight, None, targets, reduction="sum")
    ours = linear_cross_entropy(
        hidden, weight, targets, chunk_tokens=64, num_items=torch.tensor(1000), impl=impl
    )
    assert _relative(ours, ref / 1000) <= 1e-6
    nothing = torch.full((N,), -100)
    ours = linear_cross_entropy(hidden, weight, nothing, chunk_tokens=64, impl=impl)
    assert torch.isnan(ours) and torch.isnan(F.cross_entropy(hidden @ weight.T, nothing))


def test_auto_falls_back_to_the_pure_loop_without_pytorch_s_op(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cpu = torch.device("cpu")
    if headloss.native_linear_cross_entropy() is not None:
        assert resolve_implementation("auto", dtype=torch.float32, device=cpu) == "native"
    # bf16 off CUDA: PyTorch's op would upcast the weight and run fp32 GEMMs
    assert resolve_implementation("auto", dtype=torch.bfloat16, device=cpu) == "pure"
    monkeypatch.setattr(headloss, "native_linear_cross_entropy", lambda: None)
    assert resolve_implementation("auto", dtype=torch.float32, device=cpu) == "pure"
    with pytest.raises(ConfigError, match="2.13"):
        resolve_implementation("native", dtype=torch.float32, device=cpu)
    hidden, weight, _, targets = _inputs()
    ref, _ = _reference(hidden, weight, None, targets)
    assert _relative(linear_cross_entropy(hidden, weight, targets, chunk_tokens=64), ref) <= 1e-6


class _GemmDtypes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[tuple[torch.dtype, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.dtypes.add(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", HEAD_MODES)
def test_bf16_runs_bf16_gemms_and_stays_close(mode: str) -> None:
    hidden, weight, b, targets = _inputs(torch.bfloat16, bias=True)
    ref_loss, ref_grads = _reference(hidden, weight, b, targets)
    gemms = _GemmDtypes()
    with gemms:
        loss, grads = _grads(
            lambda h, w, bb: linear_cross_entropy(
                h, w, targets, bias=bb, chunk_tokens=64, mode=mode, impl="auto"
            ),
            hidden,
            weight,
            b,
        )
    assert gemms.dtypes == {tuple([torch.bfloat16] * n) for n in {len(d) for d in gemms.dtypes}}
    assert _relative(loss, ref_loss) <= 1e-6  # the softmax runs in fp32, as after .float()
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert _relative(grad, ref) <= 1e-2  # bf16: one rounding per chunk of dW


@pytest.mark.parametrize("impl", IMPLS)
def test_runs_on_fake_tensors_without_data_dependent_ops(impl: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # nonzero / .item() would raise here
        hidden = torch.randn(N, H, requires_grad=True)
        weight = torch.randn(V, H, requires_grad=True)
        targets = torch.randint(0, V, (N,))
        linear_cross_entropy(hidden, weight, targets, chunk_tokens=64, impl=impl).backward()
        assert hidden.grad is not None and weight.grad is not None


@pytest.mark.parametrize("mode", HEAD_MODES)
@pytest.mark.parametrize("impl", IMPLS)
def test_peak_is_a_fraction_of_the_unchunked_one(impl: str, mode: str) -> None:
    tokens, vocab = 1024, 8192
    hidden = torch.randn(tokens, H, requires_grad=True)
    weight = torch.randn(vocab, H, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))

    def peak(step) -> int:  # type: ignore[no-untyped-def]
        tracker = LiveStorageTracker()
        base = tracker.register([hidden, weight, targets])
        with tracker:
            step()
        hidden.grad = weight.grad = None
        return tracker.peak_bytes - base

    full = peak(lambda: F.cross_entropy(hidden @ weight.T, targets).backward())
    chunk = chunk_tokens_for(tokens, H, vocab)
    assert chunk == MIN_CHUNK_TOKENS  # 1024 * 48 / 8192 = 6 -> the floor
    ours = peak(
        lambda: linear_cross_entropy(
            hidden, weight, targets, chunk_tokens=chunk, mode=mode, impl=impl
        ).backward()
    )
    weight_grad = vocab * H * 4  # both hold dW
    assert ours - weight_grad <= 0.1 * (full - weight_grad)


def test_chunk_tokens_come_from_bytes() -> None:
    # Llama-3-8B at T = 8192: N·H/V = 261.6 -> 256 (a chunk's logits ~ the head's input)
    assert chunk_tokens_for(8192, 4096, 128256) == 256
    assert chunk_tokens_for(131072, 4096, 128256) == 4096
    assert chunk_tokens_for(1024, 256, 32000) == MIN_CHUNK_TOKENS
    assert chunk_tokens_for(10, 256, 32000) == 10  # never more than N
    with pytest.raises(ConfigError):
        chunk_tokens_for(0, 1, 1)


@pytest.mark.parametrize("num_items", [None, 150], ids=["mean", "num_items"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_exact_gives_the_unchunked_hidden_gradient_bit_for_bit(
    dtype: torch.dtype, num_items: int | None
) -> None:
    """``impl="exact"``: the unchunked loss's kernels per chunk, so the hidden states' gradient
    is ``F.cross_entropy``'s bit for bit (ignored tokens, a masked chunk, a short last chunk);
    the loss value and the weight's gradient are sums over chunks (within 1e-6 relative)."""
    hidden, weight, bias, targets = _inputs(dtype, bias=True)
    reduction = "mean" if num_items is None else "sum"

    def reference(h, w, b):  # type: ignore[no-untyped-def]
        loss = F.cross_entropy(F.linear(h, w, b).float(), targets, reduction=reduction)
        return loss if num_items is None else loss / num_items

    expected, (dh, dw, db) = _grads(reference, hidden, weight, bias)
    got, (gh, gw, gb) = _grads(
        lambda h, w, b: linear_cross_entropy(
            h, w, targets, bias=b, chunk_tokens=64, impl="exact", num_items=num_items
        ),
        hidden,
        weight,
        bias,
    )
    assert torch.equal(gh, dh)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # bf16 sums round at 8 bits
    assert _relative(got, expected) <= 1e-6
    assert _relative(gw, dw) <= tolerance and _relative(gb, db) <= tolerance
    with pytest.raises(ConfigError, match="recompute"):
        linear_cross_entropy(hidden, weight, targets, chunk_tokens=64, impl="exact",
                             mode="grad-in-forward")  # fmt: skip
