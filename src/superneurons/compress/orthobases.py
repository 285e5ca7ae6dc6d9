"""Orthonormal real transforms of chunks: a real Fourier basis and the DCT-II, both via rFFT.

Each maps a batch of real chunks ``(C, L)`` (``L`` even) to ``L`` real coefficients per chunk
with ``sum(coef**2) == sum(x**2)`` per chunk (Parseval), so dropping the smallest coefficients
of any of them bounds the error the same way. Used by the transform-adaptive codec.

* **Fourier** (``fourier`` / ``inverse_fourier``): the ortho-normalised ``rfft``'s bins as
  ``[X_0, sqrt(2) Re X_1, sqrt(2) Im X_1, ..., sqrt(2) Re X_{L/2-1}, sqrt(2) Im X_{L/2-1},
  X_{L/2}]`` (bins 0 and ``L/2`` are real for real input).
* **DCT-II** (``dct`` / ``inverse_dct``): orthonormal DCT-II by Makhoul's algorithm (J. Makhoul,
  "A fast cosine transform in one and two dimensions", IEEE TASSP 1980): reorder
  ``v = [x_0, x_2, ..., x_{L-2}, x_{L-1}, ..., x_3, x_1]``, ``V = rfft(v)``, then for
  ``j = 0..L/2`` with ``w_j = exp(-i pi j / 2L)``: ``C_j = Re(V_j w_j)`` and
  ``C_{L-j} = -Im(V_j w_j)``; the inverse runs the same steps backwards with one ``irfft``.
  The DCT's even symmetric extension has no jump at the chunk edges, so smooth chunks
  compact into fewer coefficients than under the Fourier basis (Rao & Yip, "Discrete Cosine
  Transform", 1990).

Everything runs on the input's device; the twiddles are built there (no CPU constants).
"""

from __future__ import annotations

import math

import torch

__all__ = ["dct", "fourier", "inverse_dct", "inverse_fourier"]


def _sqrt2_mask(length: int, device: torch.device) -> torch.Tensor:
    """Scale of each interleaved (re, im) slot of the ``L/2 + 1`` bins: sqrt(2) for the paired
    bins, 1 for bins 0 and ``L/2``."""
    scale = torch.full((length // 2 + 1, 2), math.sqrt(2.0), device=device)
    scale[0] = 1.0
    scale[-1] = 1.0
    return scale.reshape(-1)


def fourier(chunks: torch.Tensor) -> torch.Tensor:
    """``(C, L)`` -> ``(C, L)`` orthonormal real Fourier coefficients (``L`` even)."""
    length = chunks.shape[1]
    bins = torch.view_as_real(torch.fft.rfft(chunks, norm="ortho"))  # (C, L/2+1, 2)
    slots = bins.reshape(chunks.shape[0], -1) * _sqrt2_mask(length, chunks.device)  # (C, L+2)
    # Drop Im X_0 (slot 1) and Im X_{L/2} (the last slot), both zero for real input.
    return torch.cat([slots[:, :1], slots[:, 2:-1]], dim=1)


def inverse_fourier(coef: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`fourier`."""
    count, length = coef.shape
    zero = torch.zeros(count, 1, dtype=coef.dtype, device=coef.device)
    slots = torch.cat([coef[:, :1], zero, coef[:, 1:], zero], dim=1)  # (C, L+2)
    slots = slots / _sqrt2_mask(length, coef.device)
    bins = torch.view_as_complex(slots.view(count, length // 2 + 1, 2))
    return torch.fft.irfft(bins, n=length, norm="ortho")


def _twiddle(length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of ``pi j / 2L`` for ``j = 0..L/2``, each ``(L/2 + 1,)``."""
    angle = torch.arange(length // 2 + 1, dtype=torch.float64, device=device) * (
        math.pi / (2 * length)
    )
    return torch.cos(angle).to(torch.float32), torch.sin(angle).to(torch.float32)


def _dct_scale(length: int, device: torch.device) -> torch.Tensor:
    scale = torch.full((length,), math.sqrt(2.0 / length), device=device)
    scale[0] = math.sqrt(1.0 / length)
    return scale


def dct(chunks: torch.Tensor) -> torch.Tensor:
    """``(C, L)`` -> ``(C, L)`` orthonormal DCT-II coefficients (``L`` even)."""
    count, length = chunks.shape
    half = length // 2
    reordered = torch.cat([chunks[:, 0::2], chunks[:, 1::2].flip(1)], dim=1)  # (C, L)
    spectrum = torch.view_as_real(torch.fft.rfft(reordered))  # (C, L/2+1, 2)
    re, im = spectrum[..., 0], spectrum[..., 1]
    cos, sin = _twiddle(length, chunks.device)
    # V_j * w_j = (re + i im)(cos - i sin): real part C_j, minus imaginary part C_{L-j}.
    low = re * cos + im * sin  # (C, L/2+1): C_0 .. C_{L/2}
    high = re * sin - im * cos  # (C, L/2+1): C_L(=0), C_{L-1} .. C_{L/2}
    out = torch.cat([low, high[:, 1:half].flip(1)], dim=1)  # (C, L)
    return out * _dct_scale(length, chunks.device)


def inverse_dct(coef: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`dct` (an orthonormal DCT-III)."""
    count, length = coef.shape
    half = length // 2
    raw = coef / _dct_scale(length, coef.device)  # (C, L) unnormalised C_k
    low = raw[:, : half + 1]  # C_0 .. C_{L/2}
    zero = torch.zeros(count, 1, dtype=coef.dtype, device=coef.device)
    # C_{L-j} for j = 0..L/2: C_L = 0, C_{L-1} .. C_{L/2}
    high = torch.cat([zero, raw[:, half:].flip(1)], dim=1)  # (C, L/2+1)
    cos, sin = _twiddle(length, coef.device)
    # V_j = (C_j - i C_{L-j}) * conj(w_j) = (C_j - i C_{L-j})(cos + i sin)
    re = low * cos + high * sin
    im = low * sin - high * cos
    bins = torch.complex(re, im)  # (C, L/2+1)
    reordered = torch.fft.irfft(bins, n=length)  # (C, L)
    out = torch.empty_like(reordered)
    out[:, 0::2] = reordered[:, :half]
    out[:, 1::2] = reordered[:, half:].flip(1)
    return out
