"""Row-level helpers of the adaptive codec (:mod:`superneurons.compress.adaptive`): pick each
chunk's row from its basis' coefficients, gather kept values from a transform's row-strided
buffer, and invert each chunk in its basis. Split from the codec to keep each module to one
concept; the CPU paths copy rows found with ``nonzero`` (free on the CPU), the sync-free ones
use ``torch.where`` so that no size comes back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from superneurons.codecs.coding.workspace import workspace
from superneurons.compress.orthobases import inverse_dct, inverse_fourier

__all__ = ["gather_flat", "inverse_rows", "pick_rows", "spectrum_buffer", "sync_free"]


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
