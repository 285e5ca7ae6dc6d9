"""Device-true codecs: encode, decode and decode_sum run on the input's device, with no host
round trip and no CPU tensor mixed in.

CPU proof: every codec runs on ``meta`` tensors (no data: any ``.item()``, ``bool(tensor)``,
``.tolist()``, ``nonzero`` or Python branch on a value fails there) under a dispatch mode that
records the device of every tensor each aten op consumes or produces; all must be ``meta``
(a CPU constant such as ``torch.tensor([...])`` made without ``device=`` shows up here). CUDA: the same codecs under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising call.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from superneurons.compress import CODECS, Codec, parse_spec

# Every codec by name, plus the variants whose code paths differ.
SPECS = [
    *CODECS,
    "topk:ratio=0.05,select=sampled",
    "fft:chunk=0,select=exact,index=bitmap",
    "fft:theta=0.99,bits=16,index=gap",
    "fft:theta=0.5,bits=32",
    "rangefloat:bits=32",
    "ctopk:theta=0.9,index=bitmap",
    "ctopk:theta=0.99,index=gap,bits=4",
    "adaptive:scope=chunk,index=gap,header=fixed",
    "adaptive:header=sparse",
    "adaptive:bases=spatial+dct,bits=16,chunk=64",
]


def _kthvalue_runs_on_meta() -> bool:
    try:
        torch.kthvalue(torch.empty(4, device="meta"), 2)
    except NotImplementedError:  # torch 2.4: no meta kernel (the codecs run on CPU and CUDA)
        return False
    return True


META_KTHVALUE = _kthvalue_runs_on_meta()


def _skip_without_meta_kernels(spec: str) -> None:
    if spec.startswith("adaptive") and not META_KTHVALUE:
        pytest.skip("this torch has no meta kernel for kthvalue (added in 2.5)")
    _skip_data_sized(spec, "meta tensors hold no data")


def _skip_data_sized(spec: str, why: str) -> None:
    """The adaptive codec's sparse header sizes its message from its switch count, read on
    the host: one small copy (a synchronisation on a GPU) per encode and per payload decoded."""
    if spec.startswith("adaptive") and "header=sparse" in spec:
        pytest.skip(f"adaptive header=sparse reads its switch count on the host; {why}")


class DeviceRecorder(TorchDispatchMode):
    """Records ``(op, device)`` of every tensor argument and result of every aten op."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.device]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        leaves, _ = tree_flatten((args, kwargs, out))
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                self.seen.append((str(func), leaf.device))
        return out


def _run(codec: Codec, grad: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor]:
    payload = codec.encode(grad)
    return payload, codec.decode(payload), codec.decode_sum([payload, payload])


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("numel", [7, 70_000])
def test_every_op_stays_on_the_meta_device(spec: str, numel: int) -> None:
    _skip_without_meta_kernels(spec)
    codec = parse_spec(spec)
    grad = torch.empty(numel, device="meta")
    with DeviceRecorder() as recorder:
        payload, decoded, summed = _run(codec, grad)
    foreign = sorted({op for op, device in recorder.seen if device.type != "meta"})
    assert not foreign, f"{spec}: ops touched another device: {foreign}"
    assert payload.data.device.type == "meta"
    assert payload.nbytes == codec.payload_bytes(numel)
    for out in (decoded, summed):
        assert out.device.type == "meta" and out.dtype == torch.float32
        assert out.shape == (numel,)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec", ["fft", "ctopk", "adaptive", "rangefloat", "qsgd"])
def test_half_inputs_on_meta_decode_to_float32(spec: str, dtype: torch.dtype) -> None:
    _skip_without_meta_kernels(spec)
    codec = parse_spec(spec)
    payload, decoded, _ = _run(codec, torch.empty(513, device="meta", dtype=dtype))
    assert payload.nbytes == codec.payload_bytes(513)
    assert decoded.dtype == torch.float32


@pytest.mark.parametrize("spec", SPECS)
def test_cpu_outputs_stay_on_the_cpu(spec: str) -> None:
    codec = parse_spec(spec)
    grad = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    with DeviceRecorder() as recorder:
        payload, decoded, summed = _run(codec, grad)
    assert {device.type for _, device in recorder.seen} == {"cpu"}
    assert payload.data.device == decoded.device == summed.device == grad.device


@pytest.mark.cuda
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("numel", [7, 1000, 2**20 + 3])
def test_cuda_codecs_never_synchronise(spec: str, numel: int) -> None:
    _skip_data_sized(spec, "see test_cuda_adaptive_sparse_header")
    codec = parse_spec(spec)
    grad = torch.randn(numel, device="cuda")
    reference = parse_spec(spec.replace("select=sampled", "select=exact"))
    _run(codec, grad)  # warm-up: cuFFT plans, allocator
    torch.cuda.set_sync_debug_mode("error")
    try:
        payload, decoded, summed = _run(codec, grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert payload.data.device == decoded.device == summed.device == grad.device
    assert payload.nbytes == codec.payload_bytes(numel)
    # The GPU codec is as accurate as the CPU one (selections may differ on near-ties, since
    # cuFFT and pocketfft round differently, so compare errors, not values).
    cpu = reference.decode(reference.encode(grad.cpu()))
    gpu_err = float((decoded.cpu() - grad.cpu()).norm() / grad.cpu().norm())
    cpu_err = float((cpu - grad.cpu()).norm() / grad.cpu().norm())
    assert gpu_err <= cpu_err * 1.05 + 1e-4, (gpu_err, cpu_err)


@pytest.mark.cuda
@pytest.mark.parametrize("numel", [7, 1000, 2**20 + 3])
def test_cuda_adaptive_sparse_header(numel: int) -> None:
    """header=sparse on CUDA: payloads on the device, as accurate as on the CPU, and mixed
    switch counts sum like their decodes (it synchronises once per encode and payload)."""
    codec = parse_spec("adaptive:select=exact,header=sparse")
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(numel, generator=gen), torch.randn(numel, generator=gen).cumsum(0)]
    payloads = [codec.encode(g.cuda()) for g in grads]
    assert all(p.data.device == grads[0].cuda().device for p in payloads)
    assert all(p.nbytes == codec.payload_bytes(numel) for p in payloads)
    for grad, payload in zip(grads, payloads, strict=True):
        cpu = codec.decode(codec.encode(grad))
        gpu_err = float((codec.decode(payload).cpu() - grad).norm() / grad.norm())
        cpu_err = float((cpu - grad).norm() / grad.norm())
        assert gpu_err <= cpu_err * 1.05 + 1e-4, (gpu_err, cpu_err)
    summed = codec.decode_sum(payloads).cpu()
    each = sum(codec.decode(p).cpu() for p in payloads)
    torch.testing.assert_close(summed, each, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("index", ["bitmap", "gap"])
@pytest.mark.parametrize("theta", [0.0, 0.5, 0.97])
def test_sync_free_decode_paths_equal_the_cpu_paths(index: str, theta: float) -> None:
    # The GPU paths (dense bitmap scatter, Elias-Fano by scatter) checked for values on the CPU.
    from superneurons.codecs.coding.sparsecode import KeptLayout, add_kept, kept_count

    gen = torch.Generator().manual_seed(3)
    for universe in (1, 9, 1000, 65_537):
        codec = parse_spec(f"ctopk:theta={theta},index={index},bits=8")
        payload = codec.encode(torch.randn(universe, generator=gen))
        layout = KeptLayout(universe, kept_count(universe, theta), 1, 8, index)
        outs = []
        for sync_free in (False, True):
            out = torch.zeros(universe, 1)
            assert bool(add_kept(out, payload.data, layout, sync_free=sync_free))
            outs.append(out)
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
        torch.testing.assert_close(outs[0].reshape(-1), codec.decode(payload), rtol=0, atol=0)
