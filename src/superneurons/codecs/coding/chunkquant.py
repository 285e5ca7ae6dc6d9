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

``cols * bits`` must be a multiple of 8, so every row's codes start on a byte.
"""

from __future__ import annotations

import torch

from superneurons.codecs.coding.bitpack import byte_codes, pack_bits, packed_bytes
from superneurons.codecs.coding.noise import uniform_one_two
from superneurons.errors import ConfigError

__all__ = [
    "QUANT_BITS",
    "ROUNDINGS",
    "dequantize_rows",
    "quantize_rows",
    "quantized_bytes",
    "read_rows",
    "write_rows",
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


def quantize_rows(
    x: torch.Tensor,
    *,
    bits: int,
    rounding: str,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``(rows, cols)`` uint8 and scales ``(rows,)`` float32 of the float32 ``x``.

    ``x`` must be finite (a NaN scale is the caller's business: see the two-phase reduce).
    """
    m = _levels(bits)
    if rounding not in ROUNDINGS:
        raise ConfigError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    rows, cols = x.shape
    if bits == 1 and rounding == "nearest":
        # NOTE: the L1 norm over the row, not x.abs().mean(): no (rows, cols) temporary.
        scales = torch.linalg.vector_norm(x, ord=1, dim=1).div_(cols)
        return torch.ge(x, 0).view(torch.uint8), scales
    low, high = torch.aminmax(x, dim=1)
    scales = torch.maximum(high, low.neg_())  # (rows,) the largest magnitude
    half = m / 2.0
    factor = torch.where(scales > 0, half / scales, 0.0).unsqueeze(1)  # (rows, 1)
    if rounding == "stochastic":
        # y = x * m / 2s + m/2 + u, u uniform on [0, 1) (drawn as 1 + u, hence half - 1):
        # floor(y) is the level below with probability 1 - frac, the one above with frac.
        y = uniform_one_two(rows * cols, generator=generator, device=x.device).view(rows, cols)
        y.addcmul_(x, factor).add_(half - 1.0)
    else:
        y = torch.mul(x, factor).add_(half + 0.5)  # trunc(y) = round(x * m / 2s + m/2)
    codes = y.to(torch.uint8)  # truncation: y >= 0 up to rounding (-0.0 and tiny -ε give 0)
    if rounding == "stochastic":
        codes.clamp_(max=m)  # u close to 1 on the top level
    return codes, scales


def dequantize_rows(
    codes: torch.Tensor, scales: torch.Tensor, *, bits: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``codes * 2s/m - s`` row by row (float32 ``(rows, cols)``, into ``out`` if given)."""
    m = _levels(bits)
    step = (scales * (2.0 / m)).unsqueeze(1)  # (rows, 1)
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device) if out is None else out
    out.copy_(codes)
    return out.mul_(step).sub_(scales.unsqueeze(1))


def write_rows(codes: torch.Tensor, scales: torch.Tensor, *, bits: int, out: torch.Tensor) -> None:
    """Write blocks of scales then packed codes: ``codes`` ``(blocks, rows, cols)`` uint8 and
    ``scales`` ``(blocks, rows)`` into the rows of ``out`` (uint8 ``(blocks, >= quantized_bytes)``
    with 4-byte aligned rows: the scales are viewed as float32; ``out`` may be a strided view,
    e.g. one part of every rank's segment of a message)."""
    blocks, rows, cols = codes.shape
    if cols * bits % 8:
        raise ConfigError(f"a row of {cols} codes of {bits} bits does not end on a byte")
    body = packed_bytes(rows * cols, bits)
    out[:, : 4 * rows].view(torch.float32).copy_(scales)
    out[:, 4 * rows : 4 * rows + body].copy_(pack_bits(codes.reshape(-1), bits).view(blocks, body))


def read_rows(
    data: torch.Tensor,
    rows: int,
    cols: int,
    *,
    bits: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Decode :func:`write_rows`' blocks (uint8 ``(blocks, >= quantized_bytes)``) into ``out``
    (float32 ``(blocks * rows, cols)``).

    NOTE: one gather over a 256-entry table maps each byte to its ``8 // bits`` codes at once
    (as the sign codec decodes), then one multiply and one subtraction per value; no int64
    codes, one pass over all blocks.
    """
    m = _levels(bits)
    blocks = data.shape[0]
    scales = data[:, : 4 * rows].view(torch.float32).reshape(blocks * rows, 1)
    step = scales * (2.0 / m)  # (blocks * rows, 1)
    body = data[:, 4 * rows : 4 * rows + packed_bytes(rows * cols, bits)]
    if bits == 8:
        levels = body.reshape(blocks * rows, cols)
    else:
        table = byte_codes(bits, data.device).to(torch.float32)  # (256, 8 // bits)
        index = body.reshape(-1).to(torch.int32)
        levels = table.index_select(0, index).view(blocks * rows, cols)
    torch.mul(levels, step, out=out)
    return out.sub_(scales)
