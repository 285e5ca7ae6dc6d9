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
  ``C_{L-j} = -Im(V_j w_j)``, returned in the packed real-FFT order (see :func:`dct`); the
  inverse runs the same steps backwards with one ``irfft``.
  The DCT's even symmetric extension has no jump at the chunk edges, so smooth chunks
  compact into fewer coefficients than under the Fourier basis (Rao & Yip, "Discrete Cosine
  Transform", 1990).

Everything runs on the input's device; the twiddles are built there (no CPU constants).

A chunk's basis is named by its *code*, its position in :data:`BASES`. Across bases, per chunk
(row): :func:`pick_rows` takes each chunk's row from its basis' coefficients, :func:`gather_flat`
gathers kept values from a transform's row-strided buffer, :func:`inverse_rows` inverts each chunk
in its basis. The CPU paths copy rows found with ``nonzero`` (free on the CPU); the sync-free ones
use ``torch.where`` so that no size comes back to the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from superneurons.codecs.coding.workspace import workspace

__all__ = [
    "BASES",
    "dct",
    "fourier",
    "gather_flat",
    "inverse_dct",
    "inverse_fourier",
    "inverse_rows",
    "pick_rows",
    "spectrum_buffer",
    "sync_free",
]

BASES: tuple[str, ...] = ("spatial", "fourier", "dct")  # basis code = position here


def _out(chunks: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(chunks)
    if out.shape != chunks.shape or out.dtype != chunks.dtype:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, expected {tuple(chunks.shape)}")
    return out


def _spectrum(
    chunks: torch.Tensor, spectrum: torch.Tensor | None, twiddle: torch.Tensor | None = None
) -> torch.Tensor:
    """``(C, L + 2)``: the unnormalised ``rfft`` of each row as (re, im) pairs, times
    ``twiddle`` when given, in ``spectrum`` (a caller's ``(C, L + 2)`` buffer) or a fresh one.

    NOTE: ``rfft(out=...)`` computes into a temporary and copies (ATen's CPU kernels), one
    extra pass; the caller's kept buffer still saves time on the CPU, where the two fresh
    multi-MiB spectra of the adaptive codec were trimmed and page-faulted back every call.
    """
    count, length = chunks.shape
    if spectrum is None:
        bins = torch.fft.rfft(chunks)  # (C, L/2+1)
    else:
        if spectrum.shape != (count, length + 2) or spectrum.dtype != chunks.dtype:
            raise ValueError(f"spectrum must be {(count, length + 2)} {chunks.dtype}")
        bins = torch.view_as_complex(spectrum.view(count, length // 2 + 1, 2))
        torch.fft.rfft(chunks, out=bins)
    if twiddle is not None:
        bins.mul_(twiddle)
    return torch.view_as_real(bins).reshape(count, length + 2)


def fourier(
    chunks: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    spectrum: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(C, L)`` -> ``(C, L)`` orthonormal real Fourier coefficients (``L`` even), written
    into ``out`` when given, else a view (row stride ``L + 2``) of the spectrum's buffer (no
    extra copy): ``spectrum``, a caller's ``(C, L + 2)`` buffer, or a fresh one."""
    count, length = chunks.shape
    slots = _spectrum(chunks, spectrum)  # (C, L + 2), unnormalised (re, im) pairs
    # Packed real-FFT layout: Im X_0 (slot 1) is zero for real input, so it carries the other
    # unpaired bin Re X_{L/2}; paired bins scale by sqrt(2/L), unpaired ones by sqrt(1/L).
    first = slots[:, 0] * math.sqrt(1.0 / length)  # (C,)
    coef = slots[:, :length].mul_(math.sqrt(2.0 / length))
    coef[:, 0] = first
    coef[:, 1] = slots[:, length] * math.sqrt(1.0 / length)
    return coef if out is None else _out(chunks, out).copy_(coef)


def inverse_fourier(coef: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`fourier`, written into ``out`` when given."""
    count, length = coef.shape
    # consumed by the irfft: a kept CPU buffer (superneurons.codecs.coding.workspace)
    slots = workspace("orthobases.inverse.slots", (count, length + 2), coef.dtype, coef.device)
    torch.mul(coef, math.sqrt(0.5 * length), out=slots[:, :length])  # unnormalised bins
    slots[:, length] = coef[:, 1] * math.sqrt(length)
    slots[:, 0] = coef[:, 0] * math.sqrt(length)
    slots[:, 1] = 0.0
    slots[:, length + 1] = 0.0
    bins = torch.view_as_complex(slots.view(count, length // 2 + 1, 2))
    signal = torch.fft.irfft(bins, n=length)
    if out is None:
        return signal
    return _out(coef, out).copy_(signal)


def _twiddle(length: int, device: torch.device) -> torch.Tensor:
    """``sqrt(2 / L) * exp(-i pi j / 2L)`` for ``j = 0..L/2``: complex64 ``(L/2 + 1,)``,
    Makhoul's twiddle times the orthonormal DCT scale."""
    angle = torch.arange(length // 2 + 1, dtype=torch.float64, device=device) * (
        -math.pi / (2 * length)
    )
    return torch.polar(torch.full_like(angle, math.sqrt(2.0 / length)), angle).to(torch.complex64)


def _makhoul_order(length: int, device: torch.device) -> torch.Tensor:
    """``[0, 2, ..., L-2, L-1, L-3, ..., 1]``: Makhoul's reorder as one gather (cheaper than a
    strided copy and a ``flip``)."""
    index = torch.arange(length, device=device)
    return torch.where(index < length // 2, 2 * index, 2 * (length - index) - 1)


def dct(
    chunks: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    spectrum: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(C, L)`` -> ``(C, L)`` orthonormal DCT-II coefficients (``L`` even) in the packed
    real-FFT order ``[C_0, C_{L/2}, C_1, -C_{L-1}, C_2, -C_{L-2}, ..., C_{L/2-1},
    -C_{L/2+1}]`` (a signed permutation of the standard order: still orthonormal, and one
    pass cheaper than reordering), written into ``out`` when given, else a view (row stride
    ``L + 2``) of the spectrum's buffer (``spectrum``, as in :func:`fourier`)."""
    count, length = chunks.shape
    # the reorder is consumed by the rfft: a kept CPU buffer (superneurons.codecs.coding.workspace)
    reordered = workspace("orthobases.dct.reorder", (count, length), chunks.dtype, chunks.device)
    torch.index_select(chunks, 1, _makhoul_order(length, chunks.device), out=reordered)
    # Y_j = V_j w_j: C_j = Re Y_j (j = 0..L/2), -C_{L-j} = Im Y_j (j = 1..L/2-1).
    slots = _spectrum(reordered, spectrum, _twiddle(length, chunks.device))  # (C, L + 2)
    del reordered
    slots[:, 0] *= math.sqrt(0.5)  # C_0's orthonormal scale is sqrt(1/L)
    slots[:, 1] = slots[:, length]  # Im Y_0 = 0: its slot carries C_{L/2}
    coef = slots[:, :length]
    return coef if out is None else _out(chunks, out).copy_(coef)


def inverse_dct(coef: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`dct` (an orthonormal DCT-III), written into ``out`` when given."""
    count, length = coef.shape
    half = length // 2
    out = _out(coef, out)
    # Y_j = C_j - i C_{L-j} (C_L = 0, so Im Y_0 = 0; Y_{L/2} = C_{L/2} (1 - i)).
    slots = workspace("orthobases.inverse.slots", (count, length + 2), coef.dtype, coef.device)
    slots[:, :length] = coef
    slots[:, 0] *= math.sqrt(2.0)
    slots[:, 1] = 0.0
    slots[:, length] = coef[:, 1]
    slots[:, length + 1] = -coef[:, 1]
    # 1 / w_j = conj(w_j) / |w_j|^2 and |w_j|^2 = 2 / L.
    unturn = _twiddle(length, coef.device).conj() * (0.5 * length)
    bins = torch.view_as_complex(slots.view(count, half + 1, 2)).mul_(unturn)
    reordered = torch.fft.irfft(bins, n=length)  # (C, L)
    # Undo the reorder: x_{order[i]} = v_i, i.e. x = v[inverse order].
    order = _makhoul_order(length, coef.device)
    inverse = torch.empty_like(order).index_copy_(
        0, order, torch.arange(length, device=coef.device)
    )
    return torch.index_select(reordered, 1, inverse, out=out)


def sync_free(tensor: torch.Tensor) -> bool:
    """Whether to take the paths that size nothing from data (every device but the CPU, where
    ``nonzero`` waits for nothing and row copies beat a broadcast ``torch.where`` ~20x)."""
    return tensor.device.type != "cpu"


def spectrum_buffer(code: int, count: int, length: int, device: torch.device) -> torch.Tensor:
    """A kept ``(C, L + 2)`` CPU buffer for basis ``code``'s spectrum (fresh elsewhere):
    encode-internal, every kept value is copied out of it into the payload."""
    return workspace(f"adaptive.spectrum.{code}", (count, length + 2), torch.float32, device)


def gather_flat(matrix: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``matrix.reshape(-1).index_select(0, indices)`` for a ``(C, L)`` matrix, without the
    full copy ``reshape`` makes of a transform's row-strided view (row stride ``L + 2``): one
    gather from the underlying rows, each index moved past the rows' padding."""
    count, length = matrix.shape
    pitch = matrix.stride(0)
    if matrix.is_contiguous() or matrix.stride(1) != 1:
        return matrix.reshape(-1).index_select(0, indices)
    rows = torch.as_strided(matrix, ((count - 1) * pitch + length,), (1,))
    if length & (length - 1) == 0:  # NOTE: a shift, ~4x cheaper than an int64 division
        row = indices >> (length.bit_length() - 1)
    else:
        row = torch.div(indices, length, rounding_mode="floor")
    return rows.index_select(0, indices.add(row, alpha=pitch - length))


def pick_rows(
    coefs: Sequence[torch.Tensor], slot: torch.Tensor, *, sync_free: bool
) -> torch.Tensor:
    """``(C, L)``: row ``c`` of ``coefs[slot[c]]``: with ``sync_free`` by ``torch.where``,
    else in place in the last candidate (a transform's own buffer, or the only candidate,
    then returned as is), each other candidate's rows found with ``nonzero`` and copied."""
    if not sync_free:
        out = coefs[-1]
        for index, coef in enumerate(coefs[:-1]):
            rows = (slot == index).nonzero().reshape(-1)
            out.index_copy_(0, rows, coef.index_select(0, rows))
        return out
    out = coefs[0]
    for index, coef in enumerate(coefs[1:], start=1):
        out = torch.where((slot == index).unsqueeze(1), coef, out)
    return out


def inverse_rows(coef: torch.Tensor, basis: torch.Tensor, *, sync_free: bool) -> torch.Tensor:
    """``(C, L)`` coefficients, chunk ``c`` in basis ``basis[c]`` -> the flat signal.

    With ``sync_free`` every chunk is inverted in each transform and the right one picked, so
    no size comes back to the host; else only the chunks coded in a transform are inverted
    (their rows found with ``nonzero``). ``coef`` is consumed (spatial rows are kept in place).
    """
    signal = coef
    for code, inverse in ((1, inverse_fourier), (2, inverse_dct)):
        hit = basis == code  # (C,)
        if not sync_free:
            rows = hit.nonzero().reshape(-1)
            if rows.numel():
                signal.index_copy_(0, rows, inverse(coef.index_select(0, rows)))
        else:
            signal = torch.where(hit.unsqueeze(1), inverse(coef), signal)
    return signal.reshape(-1)
