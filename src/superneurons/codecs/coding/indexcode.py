"""Fixed-size coding of the set of kept positions of a sparse message: bitmap or gap (Elias-Fano).

Gathered payloads must have a size that depends only on ``numel`` and the hyper-parameters
(gloo all-gathers equal sizes), so both codes here are fixed-size given the universe size ``T``
and the kept count ``k``:

* **bitmap**: one bit per position, ``ceil(T / 8)`` bytes;
* **gap**: Elias-Fano (Elias 1974; Fano 1971; Vigna, "Quasi-succinct indices", WSDM 2013), the
  fixed-size form of gap coding: each sorted index splits into ``l`` low bits (stored verbatim)
  and a high part whose *gaps* are stored in unary in a bit vector of ``k + (T - 1 >> l) + 1``
  bits. Total ``~ k * (l + 2)`` bits with ``l ~ log2(T / k)``; for ``k / T = 0.1`` that is about
  0.53 bits per position against the bitmap's 1. We restrict ``l`` to widths with fast packing
  (0, 1, 2, 4, 8, 16), which costs at most a few percent over the optimum.

Bitmaps use LSB-first bit order inside each byte (as :mod:`superneurons.codecs.coding.bitpack`).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from superneurons.codecs.coding import native
from superneurons.codecs.coding.bitpack import (
    pack_bits,
    pack_rows_,
    packed_bytes,
    unpack_bits,
    unpack_codes_numpy,
)
from superneurons.codecs.coding.workspace import workspace
from superneurons.errors import ConfigError

__all__ = [
    "INDEX_KINDS",
    "bitmap_bytes",
    "bitmap_positions",
    "decode_bitmap",
    "decode_gap",
    "encode_bitmap",
    "encode_gap",
    "flat_nonzero",
    "gap_bytes",
    "gap_low_bits",
    "index_bytes",
    "set_positions",
]

INDEX_KINDS: tuple[str, ...] = ("bitmap", "gap")
_LOW_WIDTHS: tuple[int, ...] = (0, 1, 2, 4, 8, 16)
# NOTE: multiply-shift bit gathering, checked exhaustively over all 256 byte patterns in the
# tests: eight 0/1 bytes in an int64 times _GATHER put bit i of the result in bit 56 + i.
_GATHER = 0x0102040810204080
_SPREAD = 0x0101010101010101
# The same 64 bits as a signed int64 (0x8040201008040201 - 2**64): torch 2.4 refuses Python
# ints >= 2**63 in int64 arithmetic ("cannot be converted to type int64_t without overflow").
_SELECT = 0x8040201008040201 - (1 << 64)


def flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Increasing int64 positions of the set entries of a 1-D bool ``mask`` (its own device).

    NOTE: on the CPU numpy's ``flatnonzero`` (a CPU-only path, so no device mix): ~4x faster
    than ``torch.nonzero`` on one thread, 0.26 vs 1.06 ms for 526k positions with 11% set
    (a shared 2-core AMD EPYC), with the same result. Other devices keep
    ``torch.nonzero`` (callers there take the sync-free paths instead).
    """
    if mask.device.type != "cpu":
        return mask.nonzero().reshape(-1)
    positions = np.flatnonzero(mask.detach().contiguous().numpy())
    return torch.from_numpy(positions.astype(np.int64, copy=False))


def set_positions(mask: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``mask.index_fill_(0, indices, True)`` for a 1-D bool ``mask``; returns ``mask``.

    NOTE: on the CPU a numpy fancy assignment, 0.06 against 0.16 ms for 52k positions in 184k
    (one thread); other devices keep ``index_fill_``.
    """
    if mask.device.type != "cpu" or not mask.is_contiguous():
        return mask.index_fill_(0, indices, True)
    mask.numpy()[indices.numpy()] = True
    return mask


def bitmap_bytes(universe: int) -> int:
    """Bytes of a bitmap over ``universe`` positions."""
    return (universe + 7) // 8


def encode_bitmap(mask: torch.Tensor) -> torch.Tensor:
    """Pack a 1-D bool ``mask`` into ``bitmap_bytes(mask.numel())`` uint8 (LSB-first)."""
    universe = mask.numel()
    nbytes = bitmap_bytes(universe)
    if mask.device.type == "cpu" and mask.dtype == torch.bool:
        # NOTE: numpy's packbits, LSB-first and zero-padded like the gather below: ~8x
        # faster on one thread (184k positions: ~0.01 vs 0.085 ms).
        packed = np.packbits(mask.detach().reshape(-1).contiguous().numpy(), bitorder="little")
        return torch.from_numpy(packed)
    flat = mask.reshape(-1).view(torch.uint8)
    if universe % 8:
        padded = torch.zeros(nbytes * 8, dtype=torch.uint8, device=mask.device)
        padded[:universe] = flat
        flat = padded
    return _pack_bytes(flat, nbytes)


def _pack_bytes(flat: torch.Tensor, nbytes: int) -> torch.Tensor:
    # flat: uint8 0/1, length a multiple of 8; each int64 word holds 8 positions -> 1 byte.
    words = flat.view(torch.int64)  # (W,)
    return (((words * _GATHER) >> 56) & 0xFF).to(torch.uint8)[:nbytes]


def decode_bitmap(data: torch.Tensor, universe: int) -> torch.Tensor:
    """Inverse of :func:`encode_bitmap`: a bool mask of ``universe`` positions."""
    need = bitmap_bytes(universe)
    if data.dtype != torch.uint8 or data.numel() < need:
        raise ConfigError(f"bitmap: need {need} uint8 bytes for {universe} positions")
    spread = (data[:need].to(torch.int64) * _SPREAD) & _SELECT  # (bytes,): bit i in lane i
    lanes = spread.view(torch.uint8).view(need, 8)  # (bytes, 8), nonzero where the bit is set
    return (lanes != 0).reshape(-1)[:universe]


def bitmap_positions(data: torch.Tensor, universe: int) -> torch.Tensor:
    """``flat_nonzero(decode_bitmap(data, universe))``: the increasing int64 positions set in a
    bitmap. NOTE: on the CPU numpy's ``unpackbits`` (LSB-first, as :func:`encode_bitmap`) and
    ``flatnonzero``: 0.1 against 0.5 ms for 367k positions (one thread)."""
    if data.device.type != "cpu":
        return flat_nonzero(decode_bitmap(data, universe))
    need = bitmap_bytes(universe)
    if data.dtype != torch.uint8 or data.numel() < need:
        raise ConfigError(f"bitmap: need {need} uint8 bytes for {universe} positions")
    bits = np.unpackbits(data[:need].contiguous().numpy(), count=universe, bitorder="little")
    return torch.from_numpy(np.flatnonzero(bits.view(np.bool_)).astype(np.int64, copy=False))


@functools.lru_cache(maxsize=4096)
def gap_low_bits(universe: int, count: int) -> int:
    """Elias-Fano low-bit width among the fast widths that minimises the size.

    NOTE: cached (a pure function of two integers): every encode, decode and layout of a
    sparse message asks for it, and the search over widths cost ~1 ms of Python per DDP bucket."""
    return min(_LOW_WIDTHS, key=lambda low: _gap_bits(universe, count, low))


def _gap_bits(universe: int, count: int, low: int) -> int:
    return count * low + _upper_bits(universe, count, low)


def _upper_bits(universe: int, count: int, low: int) -> int:
    return count + ((universe - 1) >> low) + 1


def gap_bytes(universe: int, count: int) -> int:
    """Bytes of the Elias-Fano code of ``count`` sorted positions in ``[0, universe)``."""
    low = gap_low_bits(universe, count)
    low_bytes = packed_bytes(count, low) if low else 0
    return low_bytes + bitmap_bytes(_upper_bits(universe, count, low))


def encode_gap(indices: torch.Tensor, universe: int) -> torch.Tensor:
    """Elias-Fano code of sorted, distinct int64 ``indices`` in ``[0, universe)``."""
    count = indices.numel()
    low = gap_low_bits(universe, count)
    if indices.device.type == "cpu":
        library = native.gapcode_kernels()
        if library is not None:  # the same bytes in one pass (gapcode.c)
            return _encode_gap_native(library, indices, universe, count, low)
        return _encode_gap_numpy(indices, universe, count, low)
    return _encode_gap_torch(indices, universe, count, low)


def _encode_gap_torch(indices: torch.Tensor, universe: int, count: int, low: int) -> torch.Tensor:
    """:func:`encode_gap` in torch operations (every device but the CPU)."""
    parts = []
    if low:
        parts.append(pack_bits(indices & ((1 << low) - 1), low))
    device = indices.device
    upper = torch.zeros(_upper_bits(universe, count, low), dtype=torch.bool, device=device)
    # unary gaps of the high parts
    set_positions(upper, (indices >> low) + torch.arange(count, device=device))
    parts.append(encode_bitmap(upper))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _encode_gap_native(
    library: ctypes.CDLL, indices: torch.Tensor, universe: int, count: int, low: int
) -> torch.Tensor:
    """:func:`encode_gap` by the kernel: the numpy path's bytes in one pass."""
    low_bytes = packed_bytes(count, low) if low else 0
    upper_bits = _upper_bits(universe, count, low)
    coded = torch.empty(low_bytes + bitmap_bytes(upper_bits), dtype=torch.uint8)
    if not native.gap_encode_into(
        library, indices.detach().contiguous(), low=low, low_bytes=low_bytes,
        upper_bits=upper_bits, out=coded,
    ):  # fmt: skip
        raise ConfigError(f"gap code: a position lies outside [0, {universe})")
    return coded


def _encode_gap_numpy(indices: torch.Tensor, universe: int, count: int, low: int) -> torch.Tensor:
    """:func:`encode_gap` on the CPU in numpy, written into one output array, its temporaries
    kept buffers (:mod:`.workspace`: a fresh 12 MB int64 array page-faults for longer than
    the arithmetic takes); the same bytes (tested)."""
    low_bytes = packed_bytes(count, low) if low else 0
    upper_bits = _upper_bits(universe, count, low)
    out = np.empty(low_bytes + bitmap_bytes(upper_bits), dtype=np.uint8)
    positions = indices.detach().contiguous().numpy()
    cpu = torch.device("cpu")
    if low:
        _pack_low_parts(positions, low, out[:low_bytes])
    high = workspace("indexcode.high", (count,), torch.int64, cpu).numpy()
    np.right_shift(positions, low, out=high)  # the high parts
    high += _ranks(count)  # the i-th set bit of the unary code sits at high part + i
    upper = workspace("indexcode.upper", (upper_bits,), torch.bool, cpu).numpy()
    upper[:] = False
    upper[high] = True
    np.copyto(out[low_bytes:], np.packbits(upper, bitorder="little"))
    return torch.from_numpy(out)


_kept_ranks = np.empty(0, dtype=np.int64)  # np.arange of the largest count encoded so far


def _ranks(count: int) -> np.ndarray:
    """``np.arange(count)`` (int64), a view of one kept array, made again only when it grows
    (a fresh one page-faults on every call: 8 ms for 1.5M ranks against the ~1 ms add)."""
    global _kept_ranks
    if _kept_ranks.size < count:
        _kept_ranks = np.arange(max(count, 2 * _kept_ranks.size), dtype=np.int64)
    return _kept_ranks[:count]


def _pack_low_parts(positions: np.ndarray, bits: int, out: np.ndarray) -> None:
    """``pack_bits(positions & (2**bits - 1), bits)`` into ``out`` for the gap code's low
    widths: 16 bits as little-endian words, the others by :func:`~.bitpack.pack_rows_` on
    codes zero-padded to whole 64-bit words (zero codes in the padding, as ``pack_bits``)."""
    mask = (1 << bits) - 1
    if bits == 16:
        np.bitwise_and(positions, mask, out=out.view(np.uint16), casting="unsafe")
        return
    per_word = 64 // bits
    codes = np.zeros(-(-positions.size // per_word) * per_word, dtype=np.uint8)
    np.bitwise_and(positions, mask, out=codes[: positions.size], casting="unsafe")
    packed = torch.empty(codes.size * bits // 8, dtype=torch.uint8)
    pack_rows_(torch.from_numpy(codes).view(1, -1), bits, out=packed.view(1, -1))
    out[:] = packed.numpy()[: out.size]


def decode_gap(
    data: torch.Tensor, universe: int, count: int, *, sync_free: bool | None = None
) -> torch.Tensor:
    """Inverse of :func:`encode_gap`: sorted int64 indices.

    The i-th set bit of the upper vector, at position p, holds high part ``p - i``. It is
    scattered to slot i (the rank of p) instead of listed by ``nonzero``, whose data-dependent
    output size would need a host round trip on a GPU; unset positions go to a spare slot.
    ``sync_free``: force that path (None: everywhere but the CPU, where nonzero is faster and
    has nothing to wait for).
    """
    low = gap_low_bits(universe, count)
    low_bytes = packed_bytes(count, low) if low else 0
    upper_bits = _upper_bits(universe, count, low)
    if sync_free is None:
        sync_free = data.device.type != "cpu"
    if not sync_free and data.device.type == "cpu":
        library = native.gapcode_kernels()
        if library is not None:  # the same positions in one pass (gapcode.c)
            return _decode_gap_native(library, data, count, low, low_bytes, upper_bits)
        return _decode_gap_numpy(data, count, low, low_bytes, upper_bits)
    if not sync_free:
        high = bitmap_positions(data[low_bytes:], upper_bits)
        high -= torch.arange(count, device=data.device)
    else:
        upper = decode_bitmap(data[low_bytes:], upper_bits)  # (U,)
        # NOTE: cumsum of bools accumulates in int64 ~20x slower (CPU) than in int32.
        rank = torch.cumsum(upper, 0, dtype=torch.int32).sub_(1).to(torch.int64)  # (U,)
        position = torch.arange(upper.numel(), device=data.device)  # (U,)
        slot = torch.where(upper, rank, count)  # (U,): unset bits -> the spare slot `count`
        high = torch.zeros(count + 1, dtype=torch.int64, device=data.device)
        high.index_add_(0, slot, torch.where(upper, position - rank, 0))  # one add per slot
        high = high[:count]
    if not low:
        return high
    return (high << low) | unpack_bits(data[:low_bytes], low, count)


def _decode_gap_native(
    library: ctypes.CDLL,
    data: torch.Tensor,
    count: int,
    low: int,
    low_bytes: int,
    upper_bits: int,
) -> torch.Tensor:
    """:func:`decode_gap` by the kernel: the numpy path's positions in one pass."""
    need = low_bytes + bitmap_bytes(upper_bits)
    if data.dtype != torch.uint8 or data.numel() < need:
        raise ConfigError(f"gap code: need {need} uint8 bytes for {count} positions")
    out = torch.empty(count, dtype=torch.int64)
    if not native.gap_decode_into(
        library, data.detach(), count=count, low=low, low_bytes=low_bytes,
        upper_bits=upper_bits, out=out,
    ):  # fmt: skip
        raise ConfigError(f"gap code: the bitmap does not hold the layout's {count} positions")
    return out


def _decode_gap_numpy(
    data: torch.Tensor, count: int, low: int, low_bytes: int, upper_bits: int
) -> torch.Tensor:
    """:func:`decode_gap` on the CPU in numpy, in place on one int64 array (no torch int64
    temporaries): 9 against 30 ms for 1.5M indices in 15M (one thread), the same indices."""
    need = bitmap_bytes(upper_bits)
    if data.dtype != torch.uint8 or data.numel() < low_bytes + need:
        raise ConfigError(f"gap code: need {low_bytes + need} uint8 bytes for {count} positions")
    body = data.detach().contiguous().numpy()
    bits = np.unpackbits(body[low_bytes : low_bytes + need], count=upper_bits, bitorder="little")
    high = np.flatnonzero(bits.view(np.bool_))  # (count,) int64: high part + rank
    if high.size != count:
        raise ConfigError(f"gap code: {high.size} positions set, the layout has {count}")
    high -= np.arange(count)
    if low:
        np.left_shift(high, low, out=high)
        np.bitwise_or(high, unpack_codes_numpy(body[:low_bytes], low, count), out=high)
    return torch.from_numpy(high)


@functools.lru_cache(maxsize=4096)
def index_bytes(kind: str, universe: int, count: int) -> int:
    """Bytes of the index code ``kind`` ("bitmap" or "gap")."""
    if kind == "bitmap":
        return bitmap_bytes(universe)
    if kind == "gap":
        return gap_bytes(universe, count)
    raise ConfigError(f"unknown index coding {kind!r}; use one of {list(INDEX_KINDS)}")
