"""Orthonormal real transforms of chunks: a real Fourier basis and the DCT-II, both via rFFT.

Each maps a batch of real chunks ``(C, L)`` (``L`` even) to ``L`` real coefficients per chunk
with ``sum(coef**2) == sum(x**2)`` per chunk (Parseval), so dropping the smallest coefficients
of any of them bounds the error the same way. Used by the transform-adaptive codec.

* **Fourier** (``fourier`` / ``inverse_fourier``): the ortho-normalised ``rfft``'s bins in the
  packed real layout ``[X_0, X_{L/2}, sqrt(2) Re X_1, sqrt(2) Im X_1, ..., sqrt(2) Re
  X_{L/2-1}, sqrt(2) Im X_{L/2-1}]`` (bins 0 and ``L/2`` are real for real input).
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


def fourier(chunks: torch.Tensor) -> torch.Tensor:
    """``(C, L)`` -> ``(C, L)`` orthonormal real Fourier coefficients (``L`` even)."""
    count, length = chunks.shape
    bins = torch.view_as_real(torch.fft.rfft(chunks, norm="ortho"))  # (C, L/2+1, 2)
    slots = bins.reshape(count, length + 2).mul_(math.sqrt(2.0))  # paired bins' scale
    # Packed real-FFT layout: Im X_0 (slot 1) is zero for real input, so it carries the other
    # unpaired bin Re X_{L/2}; both unpaired bins lose the sqrt(2). No copy of the bulk.
    slots[:, 0] *= math.sqrt(0.5)
    slots[:, 1] = slots[:, length] * math.sqrt(0.5)
    return slots[:, :length]


def inverse_fourier(coef: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`fourier`."""
    count, length = coef.shape
    slots = torch.empty(count, length + 2, dtype=coef.dtype, device=coef.device)
    torch.mul(coef, math.sqrt(0.5), out=slots[:, :length])
    slots[:, length] = coef[:, 1]
    slots[:, 0] = coef[:, 0]
    slots[:, 1] = 0.0
    slots[:, length + 1] = 0.0
    bins = torch.view_as_complex(slots.view(count, length // 2 + 1, 2))
    return torch.fft.irfft(bins, n=length, norm="ortho")


def _twiddle(length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of ``pi j / 2L`` for ``j = 0..L/2``, each ``(L/2 + 1,)``, times the
    orthonormal DCT scale ``sqrt(2 / L)``."""
    angle = torch.arange(length // 2 + 1, dtype=torch.float64, device=device) * (
        math.pi / (2 * length)
    )
    scale = math.sqrt(2.0 / length)
    return (torch.cos(angle) * scale).to(torch.float32), (torch.sin(angle) * scale).to(
        torch.float32
    )


def dct(chunks: torch.Tensor) -> torch.Tensor:
    """``(C, L)`` -> ``(C, L)`` orthonormal DCT-II coefficients (``L`` even)."""
    count, length = chunks.shape
    half = length // 2
    reordered = torch.empty_like(chunks)
    reordered[:, :half] = chunks[:, 0::2]
    reordered[:, half:] = chunks[:, 1::2].flip(1)
    spectrum = torch.view_as_real(torch.fft.rfft(reordered))  # (C, L/2+1, 2)
    re, im = spectrum[..., 0], spectrum[..., 1]
    cos, sin = _twiddle(length, chunks.device)  # scaled by sqrt(2/L)
    out = torch.empty_like(chunks)
    # V_j * w_j = (re + i im)(cos - i sin): real part C_j, minus imaginary part C_{L-j}.
    low = out[:, : half + 1]
    torch.mul(re, cos, out=low)
    low.addcmul_(im, sin)  # C_0 .. C_{L/2}
    high = re[:, 1:half] * sin[1:half]
    high.addcmul_(im[:, 1:half], cos[1:half], value=-1.0)  # C_{L-1} .. C_{L/2+1}
    out[:, half + 1 :] = high.flip(1)
    out[:, 0] *= math.sqrt(0.5)  # C_0's orthonormal scale is sqrt(1/L)
    return out


def inverse_dct(coef: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`dct` (an orthonormal DCT-III)."""
    count, length = coef.shape
    half = length // 2
    cos, sin = _twiddle(length, coef.device)
    # Undo the orthonormal scale: (x / sqrt(2/L)) * cos = x * (cos * sqrt(2/L)) * L / 2.
    cos, sin = cos * (0.5 * length), sin * (0.5 * length)
    low = coef[:, : half + 1].clone()  # C_0 .. C_{L/2} (orthonormal)
    low[:, 0] *= math.sqrt(2.0)
    # C_{L-j} for j = 0..L/2: C_L = 0, C_{L-1} .. C_{L/2}
    high = torch.empty_like(low)
    high[:, 0] = 0.0
    high[:, 1:] = coef[:, half:].flip(1)
    # V_j = (C_j - i C_{L-j}) * conj(w_j) = (C_j - i C_{L-j})(cos + i sin)
    bins = torch.empty(count, half + 1, 2, dtype=coef.dtype, device=coef.device)
    re, im = bins[..., 0], bins[..., 1]
    torch.mul(low, cos, out=re)
    re.addcmul_(high, sin)
    torch.mul(low, sin, out=im)
    im.addcmul_(high, cos, value=-1.0)
    reordered = torch.fft.irfft(torch.view_as_complex(bins), n=length)  # (C, L)
    out = torch.empty_like(reordered)
    out[:, 0::2] = reordered[:, :half]
    out[:, 1::2] = reordered[:, half:].flip(1)
    return out
