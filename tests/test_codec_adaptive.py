"""Transform-adaptive codec and compactly coded Top-k: Parseval bounds (global and per chunk),
basis choice, identity round trips, linear decode_sum, equal coding with fft, error feedback."""

from __future__ import annotations

import math

import pytest
import torch

from superneurons.codecs.adaptive.bases import (
    BASES,
    dct,
    fourier,
    inverse_dct,
    inverse_fourier,
    inverse_rows,
    pick_rows,
)
from superneurons.codecs.adaptive.codec import AdaptiveCodec, adaptive_layout
from superneurons.codecs.codec import Payload, sum_of_decodes
from superneurons.codecs.coding.sparsecode import KeptLayout
from superneurons.codecs.feedback import feedback_step
from superneurons.codecs.sparse.compacttopk import CompactTopKCodec
from superneurons.codecs.sparse.fft import FFTCodec
from superneurons.errors import ConfigError


def _gradients(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=gen)
    sparse = torch.zeros(n)
    spikes = max(1, n // 100)
    sparse[torch.randint(n, (spikes,), generator=gen)] = torch.randn(spikes, generator=gen) * 10
    t = torch.arange(n, dtype=torch.float32)
    smooth = torch.cumsum(normal, 0) / math.sqrt(n)
    return {
        "normal": normal,
        "heavy": normal**3,
        "smooth": smooth,
        "sparse": sparse,
        "periodic": torch.sin(t * 0.37) + 0.1 * normal,
        "mixed": torch.where(t < n / 2, sparse, smooth),
    }


def _bases_of(codec: AdaptiveCodec, payload: Payload) -> torch.Tensor:
    """The ``(C,)`` basis codes a payload carries (either header)."""
    return codec._read_basis(payload.data, payload.numel)[0]


def _err_sq(restored: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    return (restored.double() - original.double()).square()


@pytest.mark.parametrize("transform,inverse", [(fourier, inverse_fourier), (dct, inverse_dct)])
@pytest.mark.parametrize("length", [2, 4, 64, 512])
def test_bases_are_orthonormal(transform, inverse, length: int) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(9, length, generator=torch.Generator().manual_seed(length))
    coef = transform(x)
    assert coef.shape == x.shape
    torch.testing.assert_close(coef.square().sum(1), x.square().sum(1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(inverse(coef), x, rtol=1e-5, atol=1e-5)


def test_dct_matches_the_dct_ii_matrix() -> None:
    length = 32
    n = torch.arange(length, dtype=torch.float64)
    matrix = torch.cos(math.pi * n[:, None] * (2 * n[None, :] + 1) / (2 * length))
    matrix *= math.sqrt(2 / length)
    matrix[0] /= math.sqrt(2)
    # Packed real-FFT order: C_0, C_{L/2}, then (C_j, -C_{L-j}) for j = 1..L/2-1.
    order, sign = [0, length // 2], [1.0, 1.0]
    for j in range(1, length // 2):
        order += [j, length - j]
        sign += [1.0, -1.0]
    packed = matrix[order] * torch.tensor(sign, dtype=torch.float64)[:, None]
    x = torch.randn(5, length, dtype=torch.float64)
    torch.testing.assert_close(dct(x.float()).double(), x @ packed.T, rtol=0, atol=1e-5)


@pytest.mark.parametrize("header", ["sparse", "fixed"])
@pytest.mark.parametrize("theta", [0.1, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("n,chunk", [(97, 512), (4099, 256), (3001, 64)])
def test_global_scope_parseval_bound(theta: float, n: int, chunk: int, header: str) -> None:
    codec = AdaptiveCodec(
        theta=theta, bits=32, chunk=chunk, scope="global", select="exact", header=header
    )
    for name, grad in _gradients(n).items():
        err = float(_err_sq(codec.decode(codec.encode(grad)), grad).sum())
        assert err <= theta * float(grad.double().square().sum()) * (1 + 1e-5) + 1e-9, name


@pytest.mark.parametrize("theta", [0.5, 0.9, 0.97])
@pytest.mark.parametrize("n,chunk", [(4099, 256), (3001, 64)])
def test_chunk_scope_bounds_every_chunk(theta: float, n: int, chunk: int) -> None:
    codec = AdaptiveCodec(theta=theta, bits=32, chunk=chunk, scope="chunk", header="fixed")
    length, count = adaptive_layout(n, chunk)
    for name, grad in _gradients(n).items():
        err = _err_sq(codec.decode(codec.encode(grad)), grad)
        pad = count * length - n
        per_chunk_err = torch.nn.functional.pad(err, (0, pad)).view(count, length).sum(1)
        energy = torch.nn.functional.pad(grad.double().square(), (0, pad)).view(count, length)
        bound = theta * energy.sum(1) * (1 + 1e-5) + 1e-9
        assert bool((per_chunk_err <= bound).all()), name


@pytest.mark.parametrize("chunk", [64, 512])
def test_theta_zero_lossless_values_round_trip(chunk: int) -> None:
    codec = AdaptiveCodec(theta=0.0, bits=32, chunk=chunk)
    for grad in _gradients(2053).values():
        scale = float(grad.abs().max())
        torch.testing.assert_close(codec.decode(codec.encode(grad)), grad, rtol=1e-5,
                                   atol=1e-5 * scale)  # fmt: skip


def test_basis_choice_follows_the_signal() -> None:
    n, chunk = 4096, 512
    t = torch.arange(n, dtype=torch.float32)
    smooth = torch.cos(t * math.pi / chunk)  # half a cosine per chunk: DCT compacts it
    spikes = torch.zeros(n)
    spikes[::700] = 5.0  # isolated spikes: spatial
    tones = torch.cos(2 * math.pi * 16 * t / chunk)  # on-grid tone: Fourier compacts it
    for header in ("sparse", "fixed"):
        codec = AdaptiveCodec(theta=0.9, chunk=chunk, header=header)
        for signal, expected in ((smooth, "dct"), (spikes, "spatial"), (tones, "fourier")):
            head = _bases_of(codec, codec.encode(signal))
            assert {BASES[int(b)] for b in head} == {expected}


def test_restricted_bases_are_respected() -> None:
    grad = _gradients(4096)["smooth"]
    for header in ("sparse", "fixed"):
        codec = AdaptiveCodec(bases="spatial", chunk=512, header=header)
        assert bool((_bases_of(codec, codec.encode(grad)) == 0).all())
    # Spatial-only adaptive == compactly coded Top-k (same selection, same coding) up to the
    # extra universe of padding and the basis header.
    ctopk = CompactTopKCodec(theta=0.9, select="exact")
    only = AdaptiveCodec(theta=0.9, bases="spatial", chunk=512, select="exact", header="fixed")
    torch.testing.assert_close(only.decode(only.encode(grad)), ctopk.decode(ctopk.encode(grad)))


@pytest.mark.parametrize(
    "codec",
    [
        AdaptiveCodec(),
        AdaptiveCodec(scope="chunk", index="gap", header="fixed"),
        AdaptiveCodec(bits=4, chunk=64),
        AdaptiveCodec(bits=4, chunk=64, header="fixed"),
    ],
    ids=lambda c: c.spec,
)
def test_decode_sum_mixes_bases_across_ranks(codec: AdaptiveCodec) -> None:
    grads = list(_gradients(3000, seed=4).values())  # ranks choose different bases per chunk
    payloads = [codec.encode(g) for g in grads]
    torch.testing.assert_close(
        codec.decode_sum(payloads), sum_of_decodes(codec, payloads), rtol=1e-5, atol=1e-5
    )


def test_ctopk_keeps_the_largest_and_shares_fft_coding() -> None:
    grad = _gradients(10_000)["heavy"]
    codec = CompactTopKCodec(theta=0.95, bits=32)
    decoded = codec.decode(codec.encode(grad))
    kept = decoded != 0
    assert int(kept.sum()) == 500
    assert float(grad[kept].abs().min()) >= float(grad[~kept].abs().max())
    torch.testing.assert_close(decoded[kept], grad[kept], rtol=0, atol=0)
    # Equal coding: same universe and kept count cost the same bytes as fft's kept bins.
    for bits in (4, 8, 16):
        layout = KeptLayout(10_000, 500, width=1, bits=bits)
        assert CompactTopKCodec(theta=0.95, bits=bits).payload_bytes(10_000) == layout.nbytes
    fft = FFTCodec(theta=0.9, chunk=0)
    assert fft.payload_bytes(9998) == KeptLayout(5000, 500, width=2, bits=8).nbytes


def test_error_feedback_accumulates_what_was_dropped() -> None:
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(4096, generator=gen) for _ in range(20)]
    exact = torch.stack(grads).sum(0)
    for codec in (AdaptiveCodec(theta=0.95), CompactTopKCodec(theta=0.95)):
        sent = torch.zeros(4096)
        plain = torch.zeros(4096)
        residual = None
        for grad in grads:
            payload, residual = feedback_step(codec, grad, residual)
            sent += codec.decode(payload)
            plain += codec.decode(codec.encode(grad))
        # With feedback the sum of what was sent differs from the true sum by the residual only.
        torch.testing.assert_close(sent + residual, exact, rtol=1e-4, atol=1e-4)
        assert float((sent - exact).norm()) < float((plain - exact).norm())


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"chunk": 7}, "even"),
        ({"chunk": 0}, "even"),
        ({"bases": "spatial+wavelet"}, "bases"),
        ({"bases": "dct+dct"}, "bases"),
        ({"scope": "layer"}, "scope"),
        ({"theta": 1.0}, "theta"),
        ({"bits": 5}, "bits"),
        ({"margin": 1.0}, "margin"),
        ({"margin": -0.1}, "margin"),
        ({"header": "dense"}, "header"),
        ({"scope": "chunk", "header": "sparse"}, "header=fixed"),
    ],
)
def test_bad_hyper_parameters_raise_config_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AdaptiveCodec(**kwargs)  # type: ignore[arg-type]


def test_sync_free_paths_equal_the_cpu_row_paths() -> None:
    """The ``torch.where`` paths (every device but the CPU) pick and invert exactly as the
    CPU's row copies do."""
    gen = torch.Generator().manual_seed(3)
    coefs = [torch.randn(40, 64, generator=gen) for _ in range(3)]
    slot = torch.randint(0, 3, (40,), generator=gen)
    picked = pick_rows(coefs, slot, sync_free=True)
    # The CPU path picks in place in the last candidate (a transform's own buffer).
    torch.testing.assert_close(picked, pick_rows([c.clone() for c in coefs], slot, sync_free=False))
    coef = torch.randn(40, 64, generator=gen)
    torch.testing.assert_close(
        inverse_rows(coef.clone(), slot, sync_free=True),
        inverse_rows(coef.clone(), slot, sync_free=False),
    )


def test_margin_keeps_chunks_spatial_unless_a_transform_wins_clearly() -> None:
    grads = _gradients(8192, seed=2)
    grad = torch.cat([grads["mixed"], grads["normal"]])
    counts = []
    for margin in (0.0, 0.3, 0.999):
        codec = AdaptiveCodec(margin=margin, header="fixed")
        counts.append(int((_bases_of(codec, codec.encode(grad)) == 0).sum()))
    assert counts[0] <= counts[1] <= counts[2]
    assert counts[2] > counts[0]
    codec = AdaptiveCodec(margin=0.3)
    assert bool((_bases_of(codec, codec.encode(grads["smooth"])) == 2).any())  # DCT survives


@pytest.mark.parametrize(
    "bases", ["spatial", "spatial+dct", "spatial+fourier", "spatial+fourier+dct", "fourier"]
)
def test_encode_never_writes_into_the_gradient(bases: str) -> None:
    """Rows are picked in place in the transforms' buffers, never in the caller's gradient
    (a whole number of chunks in float32, so the chunks are a view of it)."""
    grad = torch.cat(list(_gradients(2048, seed=5).values()))
    before = grad.clone()
    AdaptiveCodec(theta=0.8, chunk=256, bases=bases).encode(grad)
    assert torch.equal(grad, before)


@pytest.mark.parametrize("transform", [fourier, dct])
def test_transform_view_equals_the_out_buffer(transform) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(8))
    out = torch.empty_like(x)
    assert transform(x, out=out) is out
    assert torch.equal(transform(x), out)
