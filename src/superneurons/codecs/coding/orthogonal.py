"""Shared, seeded orthogonal transforms of chunks: randomized Hadamard and randomized DCT.

A transform ``T = B · D`` is applied to every row (chunk) of a ``(rows, k)`` float32 view: ``D``
flips signs by a seeded Rademacher vector of length ``k`` and ``B`` is the orthonormal
Walsh-Hadamard matrix (``k`` a power of two) or the orthonormal DCT-II. ``T`` is orthogonal,
so ``‖T x‖ = ‖x‖`` (Parseval) and ``T⁻¹ = Tᵀ``; and it is linear and the same on every rank
(the seed and the parameter's name choose ``D``), so transformed vectors are averaged in the
transformed domain and one inverse after the average is exact: the transform idea of the seed
paper (Wang et al., HPDC'20) in a form that aggregates. THC (Li et al., "THC: Accelerating
Distributed Deep Learning Using Tensor Homomorphic Compression", NSDI'24) uses the randomized
Hadamard so: spreading a chunk's energy over all its coordinates shrinks the largest
magnitude toward the RMS, which is what a max-scaled quantiser's error grows with.

How they run on a CPU (one thread, 2**22 values, measured with ``benchmarks``-style timers
while the machine was shared, so relative only): the Hadamard as two small GEMMs by the
Kronecker factors ``H_k = H_a ⊗ H_b`` (``k = a b``) took ~3.5 passes of memory against ~5.5
for one ``k x k`` GEMM; the DCT goes through one real FFT of length ``k`` (Makhoul, "A fast
cosine transform in one and two dimensions", IEEE TASSP 1980), ~2 passes for the FFT.
"""

from __future__ import annotations

import math
import zlib
from functools import lru_cache

import torch

from superneurons.errors import ConfigError

__all__ = ["TRANSFORMS", "forward_", "inverse_", "rademacher"]

TRANSFORMS = ("none", "hadamard", "dct")


def rademacher(seed: int, name: str, k: int, device: torch.device) -> torch.Tensor:
    """The seeded ±1 float32 vector ``D`` of length ``k`` for ``name`` (equal on every rank)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    bits = torch.randint(0, 2, (k,), generator=gen, dtype=torch.int64)
    return (1.0 - 2.0 * bits.to(torch.float32)).to(device)


@lru_cache(maxsize=32)
def _hadamard_cpu(n: int) -> torch.Tensor:
    """The orthonormal ``n x n`` Sylvester-Hadamard matrix (``n`` a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    return _hadamard_cpu(n).to(device)


def _check(kind: str, k: int) -> None:
    if kind not in TRANSFORMS:
        raise ConfigError(f"transform must be one of {TRANSFORMS}, got {kind!r}")
    if kind == "hadamard" and (k < 2 or k & (k - 1)):
        raise ConfigError(f"the Hadamard transform needs a power-of-two chunk, got {k}")
    if kind == "dct" and k % 2:
        raise ConfigError(f"the DCT here needs an even chunk, got {k}")


def _hadamard_rows(x: torch.Tensor) -> torch.Tensor:
    """``x H`` for every row, by the Kronecker factors (``H`` is symmetric: its own inverse)."""
    rows, k = x.shape
    a = 1 << (k.bit_length() - 1) // 2  # k = a * b, a <= b, both powers of two
    b = k // a
    z = torch.matmul(x.reshape(rows * a, b), _hadamard(b, x.device)).view(rows, a, b)
    return torch.matmul(_hadamard(a, x.device), z).view(rows, k)


def _dct_scale(k: int, device: torch.device) -> torch.Tensor:
    scale = torch.full((k,), math.sqrt(2.0 / k), device=device)
    scale[0] = math.sqrt(1.0 / k)
    return scale


def _twiddle(k: int, device: torch.device) -> torch.Tensor:
    """``exp(-iπj / 2k)`` for ``j = 0 .. k/2``."""
    j = torch.arange(k // 2 + 1, dtype=torch.float64, device=device)
    return torch.polar(torch.ones_like(j), -math.pi * j / (2 * k)).to(torch.complex64)


def _dct_rows(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal DCT-II of every row through one real FFT (Makhoul 1980)."""
    rows, k = x.shape
    v = torch.cat([x[:, ::2], x[:, 1::2].flip(1)], dim=1)  # even, then odd reversed
    y = torch.fft.rfft(v, dim=1) * _twiddle(k, x.device)  # (rows, k/2 + 1)
    # X_j = Re(Y_j) for j <= k/2 and X_{k-j} = -Im(Y_j) for 0 < j < k/2
    out = torch.cat([y.real, y.imag[:, 1 : k // 2].flip(1).neg()], dim=1)
    return out.mul_(_dct_scale(k, x.device))


def _idct_rows(c: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_dct_rows` (orthonormal DCT-III)."""
    rows, k = c.shape
    c = c / _dct_scale(k, c.device)
    # Y_j = c_j - i c_{k-j} (c_k = 0) for j = 0 .. k/2, then undo the twiddle
    imag = torch.zeros(rows, k // 2 + 1, dtype=c.dtype, device=c.device)
    imag[:, 1:] = c[:, k // 2 :].flip(1).neg()  # -c_{k-j}, j = 1 .. k/2
    y = torch.complex(c[:, : k // 2 + 1].contiguous(), imag) * _twiddle(k, c.device).conj()
    v = torch.fft.irfft(y, n=k, dim=1)
    out = torch.empty_like(v)
    out[:, ::2] = v[:, : (k + 1) // 2]
    out[:, 1::2] = v[:, (k + 1) // 2 :].flip(1)
    return out


def forward_(x: torch.Tensor, kind: str, signs: torch.Tensor) -> torch.Tensor:
    """``T x`` for every row of the float32 ``(rows, k)`` ``x``; ``x`` may be overwritten
    (the result is returned, possibly a new tensor)."""
    rows, k = x.shape
    _check(kind, k)
    if kind == "none":
        return x
    x.mul_(signs)
    return _hadamard_rows(x) if kind == "hadamard" else _dct_rows(x)


def inverse_(y: torch.Tensor, kind: str, signs: torch.Tensor) -> torch.Tensor:
    """``Tᵀ y`` for every row (the inverse of :func:`forward_`)."""
    rows, k = y.shape
    _check(kind, k)
    if kind == "none":
        return y
    x = _hadamard_rows(y) if kind == "hadamard" else _idct_rows(y)
    return x.mul_(signs)
