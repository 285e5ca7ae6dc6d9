"""Per-chunk scaled integer quantisation at 1, 2, 4 or 8 bits, and its byte layout.

Each row of a ``(chunks, chunk)`` float32 view is one chunk with its own fp32 scale ``s``. A
code ``q`` of ``b`` bits stands for ``q * 2s/m - s`` with ``m = 2**b - 1``: ``2**b`` levels
spread evenly over ``[-s, s]`` (no level wasted on an exact zero: at 2 bits the levels are
``±s, ±s/3``, not ``-s, 0, s``). ``s`` is the chunk's largest magnitude, so every value lies
inside the grid:

* ``rounding="nearest"``: the nearest level (error at most ``s/m``);
* ``rounding="stochastic"``: one of the two neighbouring levels with probabilities that make
  the code unbiased, ``E[decode] = x`` (QSGD's argument, Alistarh et al., NeurIPS'17), the
  uniform draws from the seeded counter-based hash of :mod:`.noise`.

At one bit, nearest rounding is the scaled sign of EF-signSGD (Karimireddy et al., ICML'19),
``s = mean |x|``, the scale with the least squared error for a sign code, as 1-bit Adam's
compressed back-end uses it (Tang et al., ICML'21); stochastic rounding keeps ``s = max |x|``
and stays unbiased. Chunked scales as in CGX (Markov et al., "CGX: Adaptive System Support
for Communication-Efficient Deep Learning", Middleware'22: buckets of 512 values).

Byte layout of ``rows`` chunks of ``cols`` values (:func:`quantized_bytes`)::

    rows float32 scales | rows * cols codes of b bits, bit-packed (bitpack.pack_bits)

``blocks * rows * cols`` must be a multiple of 8 and ``cols * bits`` too, so every block's
codes start on a byte.

Speed on a CPU thread (every pass over a gradient-sized float32 tensor costs what one memory
sweep costs): no tensor of the gradient's size is allocated per call (callers pass ``work``
and ``codes`` buffers; a fresh 100 MB tensor pays page faults worth several passes), every
operation keeps one dtype (a uint8 x float32 product ran 5-7x slower than a conversion copy
plus a float32 product here), per-row extremes are two reductions (``aminmax(dim=1)`` was 4x
slower than ``amax`` + ``amin``), and the codes are packed by byte operations
(:func:`~.bitpack.pack_rows_`) instead of a 256-entry gather.
"""

from __future__ import annotations

import numpy as np
import torch

from superneurons.codecs.coding.bitpack import pack_rows_, packed_bytes, unpack_rows
from superneurons.codecs.coding.noise import uniform_one_two
from superneurons.errors import ConfigError

__all__ = [
    "QUANT_BITS",
    "ROUNDINGS",
    "dequantize_rows",
    "quantize_rows",
    "quantized_bytes",
    "read_block",
    "read_rows",
    "write_rows_",
]

QUANT_BITS = (1, 2, 4, 8)
ROUNDINGS = ("nearest", "stochastic")


def quantized_bytes(rows: int, cols: int, bits: int) -> int:
    """Bytes of ``rows`` chunks of ``cols`` values: the scales, then the packed codes."""
    return 4 * rows + packed_bytes(rows * cols, bits)


def _levels(bits: int) -> int:
    if bits not in QUANT_BITS:
        raise ConfigError(f"quantisation bits must be one of {QUANT_BITS}, got {bits!r}")
    return (1 << bits) - 1


def _buffer(given: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if given is None:
        return torch.empty(like.shape, dtype=dtype, device=like.device)
    return given.view(like.shape)


def quantize_rows(
    x: torch.Tensor,
    *,
    bits: int,
    rounding: str,
    generator: torch.Generator | None = None,
    codes: torch.Tensor | None = None,
    work: torch.Tensor | None = None,
    noise_key: torch.Tensor | None = None,
    noise_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``(rows, cols)`` uint8 (into ``codes`` if given) and scales ``(rows,)`` float32 of
    the float32 ``x`` (``work``: a float32 scratch of ``x``'s size, else one is allocated).
    Stochastic rounding draws from ``generator``, or, with ``noise_key``
    (:func:`~.noise.draw_key`), takes positions ``noise_start ..`` of that key's draw: rows
    quantised block by block then round with the bits of one call.

    ``x`` must be finite (a NaN scale is the caller's business: see the two-phase reduce).
    """
    m = _levels(bits)
    if rounding not in ROUNDINGS:
        raise ConfigError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    rows, cols = x.shape
    codes = _buffer(codes, x, torch.uint8)
    if bits == 1 and rounding == "nearest":
        return codes, _scaled_sign(x, codes, _buffer(work, x, torch.float32))
    scales = torch.maximum(x.amax(dim=1), x.amin(dim=1).neg_())  # (rows,) largest magnitude
    half = m / 2.0
    factor = torch.where(scales > 0, half / scales, 0.0).unsqueeze(1)  # (rows, 1)
    y = _buffer(work, x, torch.float32)
    if rounding == "stochastic":
        # y = x * m / 2s + m/2 + u, u uniform on [0, 1) (drawn as 1 + u, hence half - 1):
        # floor(y) is the level below with probability 1 - frac, the one above with frac.
        noise = uniform_one_two(
            rows * cols,
            generator=generator,
            device=x.device,
            out=y.view(torch.int32),
            key=noise_key,
            start=noise_start,
        )
        y = noise.view(rows, cols).addcmul_(x, factor).add_(half - 1.0)
    else:
        torch.mul(x, factor, out=y).add_(half + 0.5)  # trunc(y) = round(x * m / 2s + m/2)
    if codes.device.type == "cpu":
        # NOTE: numpy's float32 -> uint8 conversion: ~35 us against torch's ~170 us per 2**18
        # values (one thread), the same truncation (checked on every float32 in [-2, 260]).
        with np.errstate(invalid="ignore"):  # NaN (non-finite input) casts as torch's does
            np.copyto(codes.numpy(), y.numpy(), casting="unsafe")
    else:
        codes.copy_(y)  # truncation: y >= 0 up to rounding (-0.0 and tiny -ε give 0)
    if rounding == "stochastic":
        codes.clamp_(max=m)  # u close to 1 on the top level
    return codes, scales


def _scaled_sign(x: torch.Tensor, codes: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """One-bit nearest rounding: ``codes = x >= 0`` and the rows' scales ``mean |x|``.

    NOTE: ``|x|`` into ``work`` then torch's sum, not ``vector_norm(x, ord=1)``: the norm
    adds a row's values one after another (a chain of dependent adds: ~5x slower on a CPU
    thread, 2**18 values) and rounds more (mean relative error of a 512-value row's sum
    against float64: 2.7e-7 sequential, 3.9e-8 torch's sum). On the CPU the sign test is
    numpy's (~6x faster than torch's into a bool view; the same booleans)."""
    scales = torch.sum(torch.abs(x, out=work), dim=1).div_(x.shape[1])
    flags = codes.view(torch.bool)
    if x.device.type == "cpu":
        np.greater_equal(x.numpy(), 0, out=flags.numpy())
    else:
        torch.ge(x, 0, out=flags)
    return scales


def dequantize_rows(
    codes: torch.Tensor, scales: torch.Tensor, *, bits: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``codes * 2s/m - s`` row by row (float32 ``(rows, cols)``, into ``out`` if given)."""
    m = _levels(bits)
    out = _buffer(out, codes, torch.float32)
    out.copy_(codes)
    return out.mul_((scales * (2.0 / m)).unsqueeze(1)).sub_(scales.unsqueeze(1))


def write_rows_(codes: torch.Tensor, scales: torch.Tensor, *, bits: int, out: torch.Tensor) -> None:
    """Write blocks of scales then packed codes: ``codes`` ``(blocks, rows, cols)`` uint8
    (contiguous; overwritten, see :func:`~.bitpack.pack_rows_`) and ``scales``
    ``(blocks, rows)`` into the rows of ``out`` (uint8 ``(blocks, >= quantized_bytes)`` with
    4-byte aligned rows, the scales are viewed as float32; ``out`` may be a strided view, e.g.
    one part of every rank's segment of a message)."""
    blocks, rows, cols = codes.shape
    if cols * bits % 8:
        raise ConfigError(f"a row of {cols} codes of {bits} bits does not end on a byte")
    body = packed_bytes(rows * cols, bits)
    out[:, : 4 * rows].view(torch.float32).copy_(scales)
    pack_rows_(codes.view(blocks, rows * cols), bits, out=out[:, 4 * rows : 4 * rows + body])


def read_block(
    scales: torch.Tensor,
    body: torch.Tensor,
    *,
    bits: int,
    out: torch.Tensor,
    levels: torch.Tensor,
) -> torch.Tensor:
    """Decode rows of :func:`write_rows_`' blocks: ``scales`` float32 ``(blocks, n)`` and their
    packed codes ``body`` uint8 ``(blocks, n * cols * bits / 8)`` into float32 ``out``
    ``(blocks, n, cols)`` (``levels``: a uint8 scratch of ``out``'s size). The arithmetic of
    :func:`read_rows`, on any range of rows."""
    m = _levels(bits)
    blocks, n, cols = out.shape
    codes = levels.view(-1)[: blocks * n * cols].view(blocks, n * cols)
    unpack_rows(body, bits, out=codes)
    column = scales.reshape(blocks, n, 1)
    out.copy_(codes.view(blocks, n, cols))
    return out.mul_(column * (2.0 / m)).sub_(column)


def read_rows(
    data: torch.Tensor,
    rows: int,
    cols: int,
    *,
    bits: int,
    out: torch.Tensor,
    codes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode :func:`write_rows_`' blocks (uint8 ``(blocks, >= quantized_bytes)``) into ``out``
    (float32 ``(blocks * rows, cols)``; ``codes``: a uint8 scratch of ``out``'s size)."""
    m = _levels(bits)
    blocks = data.shape[0]
    scales = data[:, : 4 * rows].view(torch.float32).reshape(blocks * rows, 1)
    body = data[:, 4 * rows : 4 * rows + packed_bytes(rows * cols, bits)]
    levels = _buffer(codes, out, torch.uint8)
    unpack_rows(body, bits, out=levels.view(blocks, rows * cols))
    out.copy_(levels)
    return out.mul_(scales * (2.0 / m)).sub_(scales)
