"""Bit-packing of small unsigned integers into bytes, vectorised in torch.

GRACE sends sign and ternary codes as whole bytes; we never do: ``pack_bits(codes, bits)``
stores ``n`` codes of ``bits`` bits each in exactly ``packed_bytes(n, bits)`` bytes
(little-endian bit order inside each byte, codes laid out consecutively).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from superneurons.errors import ConfigError

__all__ = [
    "byte_codes",
    "pack_bits",
    "pack_rows_",
    "pack_sextets",
    "packed_bytes",
    "unpack_bits",
    "unpack_codes_numpy",
    "unpack_rows",
    "unpack_sextets",
]

# NOTE: multiply-gather of 2-bit codes: four codes c0..c3 (< 4), one per byte of an int32 word
# (little-endian, byte i at bit 8i), times _GATHER2 land c_i at bit 24 + 2i of the product and
# every other partial product below bit 24 on disjoint bits (no carries), so the word's top
# byte is c0 | c1 << 2 | c2 << 4 | c3 << 6. Checked exhaustively in the tests.
_GATHER1 = 0x0102040810204080
_GATHER2 = (1 << 6) + (1 << 12) + (1 << 18) + (1 << 24)


def packed_bytes(count: int, bits: int) -> int:
    """Bytes needed for ``count`` codes of ``bits`` bits each."""
    _check_bits(bits)
    return (count * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 16:
        raise ConfigError(f"bit width must be in 1..16, got {bits}")


def _word_layout(bits: int) -> tuple[int, torch.dtype]:
    """``(codes per word, word dtype)`` for widths below 8 that do not divide 8: the fewest
    codes filling whole bytes, in int32 when they fit in 24 bits, else int64."""
    group = 8 // math.gcd(bits, 8)
    return group, torch.int32 if group * bits <= 24 else torch.int64


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integer ``codes`` (each < 2**bits) into a 1-D uint8 tensor."""
    _check_bits(bits)
    codes = codes.reshape(-1)
    count = codes.numel()
    out_bytes = packed_bytes(count, bits)
    if count == 0:
        return torch.zeros(0, dtype=torch.uint8, device=codes.device)
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    if bits == 16:
        return codes.to(torch.int32).to(torch.int16).contiguous().view(torch.uint8)
    if bits in (1, 2, 4):
        # NOTE: fast paths, codes copied to bytes (zero-padded to whole output bytes). 1 bit:
        # eight 0/1 bytes in an int64 times _GATHER1 put bit i of the product in bit 56 + i
        # (indexcode.py's bitmap gather); 2 bits: see _GATHER2; 4 bits: two nibbles per byte.
        per = 8 // bits
        padded = torch.zeros(out_bytes * per, dtype=torch.uint8, device=codes.device)
        padded[:count] = codes
        if bits == 4:
            pairs = padded.view(out_bytes, 2)
            return pairs[:, 1].bitwise_left_shift(4).bitwise_or_(pairs[:, 0])
        word, gather = (torch.int64, _GATHER1) if bits == 1 else (torch.int32, _GATHER2)
        words = padded.view(word).mul_(gather)  # (out_bytes,)
        size = words.element_size()
        return words.view(torch.uint8).view(out_bytes, size)[:, size - 1].contiguous()
    if bits == 6 and count % 4 == 0:
        out = torch.empty(out_bytes, dtype=torch.uint8, device=codes.device)
        pack_sextets(codes.to(torch.uint8, copy=True), out=out)
        return out
    if bits < 8:
        # NOTE: g = 8 / gcd(bits, 8) codes of b bits are exactly g*b/8 bytes: OR them into one
        # word (one column at a time: no (groups, g) temporaries) and keep its low bytes
        # (little-endian, as on every device torch runs on). int32 words where g*b <= 24.
        group, word = _word_layout(bits)
        groups = -(-count // group)
        padded = torch.zeros(groups * group, dtype=word, device=codes.device)
        padded[:count] = codes
        columns = padded.view(groups, group)
        words = torch.empty(groups, dtype=word, device=codes.device).copy_(columns[:, 0])
        for j in range(1, group):
            words |= columns[:, j] << (j * bits)  # disjoint bits
        width = group * bits // 8
        size = words.element_size()
        return words.view(torch.uint8).view(groups, size)[:, :width].reshape(-1)[:out_bytes]
    # Generic width (9..15 bits): expand to a bit matrix, then fold 8 bits per byte.
    bit_index = torch.arange(bits, dtype=torch.int32, device=codes.device)  # (bits,)
    bit_matrix = (codes.to(torch.int32).unsqueeze(1) >> bit_index) & 1  # (count, bits)
    flat = torch.zeros(out_bytes * 8, dtype=torch.uint8, device=codes.device)
    flat[: count * bits] = bit_matrix.reshape(-1).to(torch.uint8)
    weights = (1 << torch.arange(8, dtype=torch.int32, device=codes.device)).to(torch.int32)
    return (flat.view(out_bytes, 8).to(torch.int32) * weights).sum(dim=1).to(torch.uint8)


def unpack_bits(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``count`` codes as an int64 tensor."""
    _check_bits(bits)
    need = packed_bytes(count, bits)
    if data.dtype != torch.uint8 or data.numel() < need:
        raise ConfigError(
            f"unpack_bits: need {need} uint8 bytes for {count} codes of {bits} bits, "
            f"got {data.numel()} of {data.dtype}"
        )
    data = data[:need]
    if count == 0:
        return torch.zeros(0, dtype=torch.int64, device=data.device)
    if bits == 8:
        return data.to(torch.int64)
    if bits == 16:
        # NOTE: clone: a slice at an odd byte offset cannot be viewed as int16.
        return data.clone().view(torch.int16).to(torch.int64) & 0xFFFF
    if bits == 6 and count % 4 == 0:
        return unpack_sextets(data, count).to(torch.int64)
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=data.device)  # (8 // bits,)
        mask = (1 << bits) - 1
        grid = (data.unsqueeze(1) >> shifts) & mask  # (bytes, per)
        return grid.reshape(-1)[:count].to(torch.int64)
    if bits < 8:
        group, word = _word_layout(bits)
        width = group * bits // 8
        groups = -(-count // group)
        size = torch.empty((), dtype=word).element_size()
        buffer = torch.zeros(groups, size, dtype=torch.uint8, device=data.device)
        whole = need // width  # groups fully present in data
        buffer[:whole, :width] = data[: whole * width].view(whole, width)
        if whole < groups:
            buffer[whole, : need - whole * width] = data[whole * width :]
        words = buffer.view(word).view(-1)  # (groups,)
        codes = torch.empty(groups, group, dtype=torch.int64, device=data.device)
        for j in range(group):
            codes[:, j] = (words >> (j * bits)) & ((1 << bits) - 1)
        return codes.view(-1)[:count]
    shifts8 = torch.arange(8, dtype=torch.uint8, device=data.device)
    flat_bits = ((data.unsqueeze(1) >> shifts8) & 1).reshape(-1)[: count * bits]
    bit_matrix = flat_bits.view(count, bits).to(torch.int64)  # (count, bits)
    weights = 1 << torch.arange(bits, dtype=torch.int64, device=data.device)
    return (bit_matrix * weights).sum(dim=1)


def pack_sextets(
    codes: torch.Tensor, *, out: torch.Tensor, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """6-bit codes (uint8, each < 64, a multiple of 4 of them) into ``out`` (uint8, 3 bytes per
    4 codes), the same bytes as ``pack_bits(codes, 6)``; ``codes`` is overwritten.

    Four codes, one per byte of an int32 word, are merged in two SWAR steps (pairs into 12-bit
    halves, then halves into 24 bits) and the low three bytes of each word are kept: ~10
    in-place passes over ``count / 4`` words instead of a (count, 4) reduction. ``scratch``:
    optional int32 tensor of >= count / 4 elements (saves an allocation). Little-endian byte
    order, as on every device torch runs on (x86, ARM, CUDA).
    """
    words = codes.view(torch.int32)  # (g,): byte i = code 4 * word + i
    groups = words.numel()
    if scratch is None:
        scratch = torch.empty_like(words)
    low = scratch.view(-1)[:groups]
    torch.bitwise_and(words, 0x003F003F, out=low)  # codes 0 and 2 stay in place
    words.bitwise_right_shift_(2).bitwise_and_(0x0FC00FC0).bitwise_or_(low)  # 1 -> bit 6, 3 -> 22
    torch.bitwise_and(words, 0xFFF, out=low)  # codes 0..1
    words.bitwise_right_shift_(4).bitwise_and_(0x00FFF000).bitwise_or_(low)  # 2..3 -> bit 12
    out.view(groups, 3).copy_(words.view(torch.uint8).view(groups, 4)[:, :3])
    return out


def unpack_sextets(data: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_sextets`: ``count`` (a multiple of 4) codes as uint8."""
    groups = count // 4
    buffer = torch.empty(2 * groups, 4, dtype=torch.uint8, device=data.device)
    words = buffer[:groups]
    words[:, :3] = data[: 3 * groups].view(groups, 3)  # byte 3 is masked off below
    words = words.view(torch.int32).view(-1)  # (g,)
    high = buffer[groups:].view(torch.int32).view(-1)  # (g,) scratch
    torch.bitwise_and(words, 0x00FFF000, out=high).bitwise_left_shift_(4)  # codes 2..3 -> 16
    words.bitwise_and_(0xFFF).bitwise_or_(high)
    torch.bitwise_and(words, 0x0FC00FC0, out=high).bitwise_left_shift_(2)  # 1 -> 8, 3 -> 24
    words.bitwise_and_(0x003F003F).bitwise_or_(high)
    return words.view(torch.uint8)


def byte_codes(bits: int, device: torch.device) -> torch.Tensor:
    """The ``8 // bits`` codes packed in each of the 256 byte values, as ``pack_bits`` lays
    them out (least significant first): an int32 ``(256, 8 // bits)`` table, so a decode can map
    every payload byte to its values with one gather (``bits`` in 1, 2, 4, 8)."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"byte_codes needs bits in (1, 2, 4, 8), got {bits}")
    byte = torch.arange(256, dtype=torch.int32, device=device).unsqueeze(1)  # (256, 1)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=device)  # (8 // bits,)
    return (byte >> shifts) & ((1 << bits) - 1)


@functools.cache
def _byte_table_2bit() -> np.ndarray:
    """The four 2-bit codes of each byte value, little-endian in one uint32 (as unpacked)."""
    byte = np.arange(256, dtype=np.uint32)
    return (byte & 3) | ((byte >> 2 & 3) << 8) | ((byte >> 4 & 3) << 16) | ((byte >> 6) << 24)


def pack_rows_(codes: torch.Tensor, bits: int, *, out: torch.Tensor) -> torch.Tensor:
    """``pack_bits`` of each row of ``codes`` (uint8 ``(blocks, n)``, contiguous, ``n * bits`` a
    multiple of 64) written into ``out`` (uint8 ``(blocks, n * bits / 8)``, may be a strided
    view of a larger message), ``bits`` in 1, 2, 4, 8. No allocation: ``codes`` is used as the
    multiply-gather's words and is overwritten (1 and 2 bits)."""
    if bits == 8:
        return out.copy_(codes)
    if bits == 4 and codes.device.type == "cpu":
        # NOTE: two codes in a 16-bit word w = c0 + 256 c1 (c0 < 16): the low byte of
        # w | w >> 4 is c0 | c1 << 4; numpy's uint16 ops and narrowing copy: ~40 us against
        # ~290 us for the strided uint8 shift and or below (2**18 codes, one thread).
        pairs16 = codes.numpy().view(np.uint16)
        np.bitwise_or(pairs16, pairs16 >> 4, out=pairs16)
        np.copyto(out.numpy(), pairs16, casting="unsafe")  # uint16 -> uint8: the low byte
        return out
    if bits == 4:
        pairs = codes.view(codes.shape[0], -1, 2)
        torch.bitwise_left_shift(pairs[..., 1], 4, out=out)
        return out.bitwise_or_(pairs[..., 0])
    if bits not in (1, 2):
        raise ConfigError(f"pack_rows_ packs 1, 2, 4 or 8 bits, got {bits}")
    if bits == 1 and codes.device.type == "cpu":
        # NOTE: numpy's packbits (LSB-first, as the gather below): one pass instead of an int64
        # multiply and a strided byte copy; codes are 0/1 (``_check`` of pack_bits' contract)
        np.copyto(out.numpy(), np.packbits(codes.numpy(), axis=-1, bitorder="little"))
        return out
    word, gather = (torch.int64, _GATHER1) if bits == 1 else (torch.int32, _GATHER2)
    words = codes.view(word).mul_(gather)  # (blocks, bytes out): the byte is the top one
    size = words.element_size()
    return out.copy_(words.view(torch.uint8).view(*out.shape, size)[..., size - 1])


def unpack_rows(data: torch.Tensor, bits: int, *, out: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_rows_`: ``data`` (uint8 ``(blocks, nbytes)``, may be strided) into
    ``out`` (uint8 ``(blocks, nbytes * 8 / bits)``, contiguous); byte operations only."""
    if bits == 8:
        return out.copy_(data)
    per = 8 // bits
    if per * bits != 8 or bits > 8:
        raise ConfigError(f"unpack_rows unpacks 1, 2, 4 or 8 bits, got {bits}")
    if bits == 4 and data.device.type == "cpu":
        # NOTE: a byte b widened to w = b, then (w | w << 4) & 0x0F0F holds b & 15 in its low
        # byte and b >> 4 in its high one: little-endian, codes 2i and 2i + 1 (as below).
        words = out.numpy().view(np.uint16)  # (blocks, nbytes)
        np.copyto(words, data.numpy(), casting="unsafe")
        np.bitwise_or(words, words << 4, out=words)
        np.bitwise_and(words, 0x0F0F, out=words)
        return out
    if bits in (1, 2) and data.device.type == "cpu":
        # NOTE: one gather per byte from a 256-entry table of its codes (1 bit: numpy's
        # unpackbits): 8 or 4 strided shift-and-mask passes were ~6x slower (one thread)
        if bits == 1:
            out.numpy()[...] = np.unpackbits(data.numpy(), axis=-1, bitorder="little")
        else:
            table = _byte_table_2bit()
            np.take(table, data.numpy(), out=out.numpy().view(np.uint32))
        return out
    slots = out.view(*data.shape, per)
    mask = (1 << bits) - 1
    for j in range(per):
        torch.bitwise_right_shift(data, j * bits, out=slots[..., j])
        if j < per - 1:  # the top code needs no mask: the shift left nothing above it
            slots[..., j].bitwise_and_(mask)
    return out


def unpack_codes_numpy(data: np.ndarray, bits: int, count: int) -> np.ndarray:
    """``unpack_bits(data, bits, count)`` on the CPU for ``bits`` in 1, 2, 4, 8, 16, as unsigned
    numpy codes (uint8; uint16 for 16 bits), without int64 temporaries: one table gather or
    byte operation per byte (2 bits: ~3x faster than the torch shifts on 1.5M codes, one
    thread). ``data``: contiguous uint8, at least ``packed_bytes(count, bits)`` of it."""
    need = packed_bytes(count, bits)
    data = data[:need]
    if bits == 8:
        return data
    if bits == 16:
        return data.view(np.uint16)
    if bits == 1:
        return np.unpackbits(data, count=count, bitorder="little")
    if bits == 2:
        return np.take(_byte_table_2bit(), data).view(np.uint8)[:count]
    if bits == 4:  # as unpack_rows: (b | b << 4) & 0x0F0F holds both nibbles, low one first
        words = np.empty(need, dtype=np.uint16)
        np.copyto(words, data, casting="unsafe")
        np.bitwise_or(words, words << 4, out=words)
        np.bitwise_and(words, 0x0F0F, out=words)
        return words.view(np.uint8)[:count]
    raise ConfigError(f"unpack_codes_numpy unpacks 1, 2, 4, 8 or 16 bits, got {bits}")
