"""Counter-based uniform noise for stochastic rounding: a seeded integer hash of the position.

QSGD and TernGrad round stochastically, which needs one uniform number per element. On one CPU
thread ``torch.rand`` (a sequential Mersenne Twister) costs ~3.8 ms per 2**20 floats, about as
much as the rest of the QSGD encode together. Counter-based generators (Salmon et al., "Parallel
Random Numbers: As Easy as 1, 2, 3", SC 2011) instead hash ``(position, key)``; here the key is
one 32-bit word drawn from the caller's ``torch.Generator`` (so ranks, resumes and seeds stay
deterministic) and the hash is two rounds of xorshift-multiply in the style of MurmurHash3's
``fmix32`` (Appleby 2011), computed in place in int32 (wrapping arithmetic). Callers use the
top bits, which the last multiplication mixes best (fmix32's final xorshift, which mixes the
high bits into the low ones, is left out).

Unbiasedness does not rest on the hash's quality: ``x = i * C1 + key (mod 2**32)`` is uniform
over all 2**32 words for every fixed ``i`` when the key is, and every later step (xor with a
logical right shift, multiplication by an odd constant) is a bijection of 32-bit words, so each
element's word is exactly uniform. The hash only decorrelates neighbouring elements. Draws of
different calls are independent because each call draws a fresh key.

Device: every tensor is made on the requested device; the key is a device tensor (no host sync).
"""

from __future__ import annotations

import torch

__all__ = ["draw_key", "uniform_bits", "uniform_one_two"]

# Odd multipliers: the golden-ratio constant (Knuth's multiplicative hashing) and fmix32's
# second constant, both as signed int32.
_C1 = -1640531535  # 0x9E3779B1
_C2 = -1028477387  # 0xC2B2AE35


def draw_key(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One uniform 32-bit word (int32, shape (1,)) on ``device`` from ``generator``: the key
    of one call's draws (pass it as ``key=`` to draw them block by block)."""
    word = torch.randint(-(2**31), 2**31, (1,), generator=generator, device=device)
    return word.to(torch.int32)


# NOTE: the CPU hashes in blocks that stay in L2 (2**15 words = 128 KiB): the ~12 passes of the
# hash then run at cache speed instead of streaming 4 MiB through memory twelve times (on one
# EPYC thread: ~4.6 ms per 2**20 words unblocked, slower than torch.rand's ~3.8 ms). Other
# devices take one block (kernel launches, not memory passes, dominate there).
_CPU_BLOCK = 2**15


def _hash_block(word: torch.Tensor, start: int, key: torch.Tensor, tmp: torch.Tensor) -> None:
    """Overwrite int32 ``word`` with the hash of positions ``start ..`` under ``key``."""
    torch.arange(start, start + word.numel(), dtype=torch.int32, device=word.device, out=word)
    word.mul_(_C1).add_(key)
    for shift, multiplier in ((16, _C2), (13, _C1)):
        # x ^= x >>> shift (logical: mask off the sign copies of the arithmetic shift)
        torch.bitwise_right_shift(word, shift, out=tmp)
        word.bitwise_xor_(tmp.bitwise_and_((1 << (32 - shift)) - 1)).mul_(multiplier)


def uniform_bits(
    numel: int,
    *,
    generator: torch.Generator | None,
    device: torch.device,
    out: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    start: int = 0,
) -> torch.Tensor:
    """``numel`` int32 words, each uniform over all 2**32 patterns (see module doc), written
    into ``out`` (an int32 tensor of >= ``numel`` elements, its first ``numel``) if given.
    ``key`` (from :func:`draw_key`; default: drawn from ``generator``) and ``start`` give the
    words of positions ``start ..`` of that key's draw, so a draw can be made block by block
    with the bits of one call."""
    word = torch.empty(numel, dtype=torch.int32, device=device) if out is None else out
    word = word.view(-1)[:numel]
    if key is None:
        key = draw_key(generator, device)
    block = _CPU_BLOCK if word.device.type == "cpu" else max(1, numel)
    tmp = torch.empty(min(block, numel), dtype=torch.int32, device=device)
    for offset in range(0, numel, block):
        stop = min(offset + block, numel)
        _hash_block(word[offset:stop], start + offset, key, tmp[: stop - offset])
    return word


def uniform_one_two(
    numel: int,
    *,
    generator: torch.Generator | None,
    device: torch.device,
    out: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    start: int = 0,
) -> torch.Tensor:
    """``numel`` float32 values ``1 + j / 2**23`` with ``j`` uniform on ``0 .. 2**23 - 1``: a
    uniform draw from [1, 2) on a 2**-23 grid, built from the hash's top 23 bits in place
    (``out``, ``key``, ``start``: as in :func:`uniform_bits`)."""
    word = uniform_bits(numel, generator=generator, device=device, out=out, key=key, start=start)
    word.bitwise_right_shift_(9).bitwise_and_(0x007FFFFF).bitwise_or_(0x3F800000)
    return word.view(torch.float32)
