"""Range-based float quantization: an N-bit float whose exponent range is set per message.

Wang et al., "FFT-based Gradient Sparsification for the Distributed Training of Deep Neural
Networks", HPDC 2020 (arXiv 1811.08596), quantize the surviving values with a *range-based*
float: one sign bit, ``e`` exponent bits and ``N - 1 - e`` mantissa bits, where the exponent
window is placed per message between a threshold and the largest magnitude, so that no
exponent code is spent on binades the message does not use. The paper gives no code; this is
our reconstruction (CONTEXT.md section 2):

* the top binade is ``b = floor(log2(max|v|))``; the ``2**e - 1`` normal exponent codes cover
  ``[2**(b - 2**e + 2), 2**(b + 1))`` and exponent code 0 holds IEEE-style subnormals (so zero
  and values below the window are represented with a fixed absolute step);
* with a ``threshold`` the exponent bits are ``ceil(log2(log2(max/threshold) + 1))`` (the
  paper's rule, capped so at least a few mantissa bits remain); without one they are chosen
  per message to minimise the estimated squared error from a histogram of binades;
* rounding is to nearest; magnitudes above the top code saturate.

Per-element error (tested): for ``|v|`` inside the window ``|q - v| <= 2**-(m+1) * |v|``
(``m`` mantissa bits, plus a tie of one ulp at saturation), below it ``|q - v| <= step / 2``
with ``step = 2**(lowest normal exponent - m)``.

Wire format of :class:`RangeFloatCodec` (``bits < 32``): an 8-byte header (float32 ``max``,
uint8 exponent bits, 3 reserved bytes) followed by the codes bit-packed at ``bits`` each.
``bits = 32`` sends the raw float32 bytes (lossless; no header).

NaN/Inf policy (project-wide): ``encode`` never raises on values. If any input value is not
finite, the header scale is NaN and the payload decodes to all-NaN, so a DDP hook propagates
the non-finite gradient as a dense all-reduce would and AMP's ``GradScaler`` skips the step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from superneurons.compress.bitpack import pack_bits, packed_bytes, unpack_bits
from superneurons.compress.codec import Payload, check_gradient, sum_of_decodes
from superneurons.errors import ConfigError

__all__ = [
    "HEADER_BYTES",
    "SUPPORTED_BITS",
    "RangeFloatCodec",
    "RangeFloatHeader",
    "dequantize",
    "exponent_bits_for_range",
    "quantize",
    "read_codes",
    "write_codes",
]

logger = logging.getLogger("superneurons.compress")

SUPPORTED_BITS: tuple[int, ...] = (4, 8, 16, 32)
HEADER_BYTES = 8  # float32 max, uint8 exponent bits, 3 reserved bytes
_MIN_NORMAL_EXP = -126  # float32's smallest normal binade


@dataclass(frozen=True)
class RangeFloatHeader:
    """Per-message range: the largest magnitude (NaN flags non-finite input) and the split of
    the ``bits - 1`` magnitude bits into exponent and mantissa."""

    max_abs: float
    exp_bits: int

    def to_bytes(self) -> torch.Tensor:
        out = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        out[:4] = torch.tensor([self.max_abs], dtype=torch.float32).view(torch.uint8)
        out[4] = self.exp_bits
        return out

    @classmethod
    def from_bytes(cls, data: torch.Tensor) -> RangeFloatHeader:
        max_abs = float(data[:4].clone().view(torch.float32)[0])
        return cls(max_abs=max_abs, exp_bits=int(data[4]))


def check_bits(bits: int, *, owner: str) -> None:
    """Raise a helpful ConfigError unless ``bits`` is a supported range-float width."""
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ConfigError(
            f"{owner}: bits={bits!r} is not supported; use one of {list(SUPPORTED_BITS)} "
            "(32 = lossless float32)"
        )


def _max_exp_bits(bits: int) -> int:
    # NOTE: keep at least max(1, (bits - 1) // 3) mantissa bits (8 bits: e <= 5, m >= 2);
    # a window wider than 2**31 binades buys nothing for gradients' L2 error.
    return bits - 1 - max(1, (bits - 1) // 3)


def _floor_log2(value: float) -> int:
    return math.frexp(value)[1] - 1


def exponent_bits_for_range(max_abs: float, threshold: float, bits: int) -> int:
    """The paper's rule ``ceil(log2(log2(max/threshold) + 1))``, on whole binades, capped so
    mantissa bits remain; at least 1."""
    if not (threshold > 0.0 and max_abs > 0.0):
        return 1
    binades = _floor_log2(max_abs) - _floor_log2(threshold) + 1  # binades the range touches
    exp_bits = max(1, math.ceil(math.log2(binades + 1)))  # 2**e - 1 normal codes >= binades
    return min(exp_bits, _max_exp_bits(bits))


def _window_base(top: int, exp_bits: int) -> int:
    """``lo``: exponent code ``E >= 1`` means binade ``lo + E``; code 0 holds subnormals.

    Kept >= -126 so that binade ``lo`` is a normal float32 (the branch-free codecs need it)."""
    return max(top - 2**exp_bits + 1, _MIN_NORMAL_EXP)


def _best_exponent_bits(mag_bits: torch.Tensor, top: int, bits: int) -> int:
    """Exponent bits minimising the estimated squared error, from a histogram of binades.

    ``mag_bits``: float32 bit patterns of the magnitudes. A value in binade ``k`` inside the
    window costs ~``(2**(k-m))**2/12``; below it ``min(value**2, step**2 / 12)`` with the
    subnormal step ``2**(lo + 1 - m)``. The histogram is taken on a strided sample of at most
    ~64k values (an estimate suffices; the max is exact).
    """
    stride = max(1, mag_bits.numel() // 65536)
    biased = mag_bits[::stride] >> 23  # (s,) float32 biased exponents; zero -> 0
    offset = (top + 127 - biased).clamp_(0, 63)  # binade top - offset; zeros land in 63
    counts = torch.bincount(offset, minlength=64).to(torch.float64)  # (64,)
    j = torch.arange(64, dtype=torch.float64)
    energy = counts * torch.exp2(-2.0 * j) * (7.0 / 3.0)  # E[v**2] within a binade, / 4**top
    best, best_err = 1, math.inf
    for exp_bits in range(1, _max_exp_bits(bits) + 1):
        mant = bits - 1 - exp_bits
        window = 2**exp_bits - 1
        inside = counts[:window] * torch.exp2(-2.0 * (j[:window] + mant)) / 12.0
        sub_step = 2.0 ** (-(window - 1) - mant)
        below = torch.minimum(energy[window:], counts[window:] * sub_step**2 / 12.0)
        err = float(inside.sum() + below.sum())
        if err < best_err:
            best, best_err = exp_bits, err
    return best


def quantize(
    values: torch.Tensor, bits: int, *, threshold: float | None = None
) -> tuple[torch.Tensor, RangeFloatHeader]:
    """Quantize float ``values`` to ``bits``-bit range-float codes (int32, sign in the top bit).

    ``threshold``: smallest magnitude the window must cover (the paper's rule); ``None`` picks
    the exponent bits that minimise the estimated squared error. Non-finite input gives a NaN
    header (decodes to all-NaN).
    """
    check_bits(bits, owner="rangefloat")
    if bits == 32:
        raise ConfigError("rangefloat: bits=32 is the lossless float32 path; no codes to make")
    v_bits = values.reshape(-1).to(torch.float32).contiguous().view(torch.int32)  # (n,)
    mag_bits = v_bits & 0x7FFFFFFF  # (n,) |v| as float32 bits: integer order == float order
    max_bits = int(mag_bits.max()) if v_bits.numel() else 0
    if max_bits >= 0x7F800000:  # inf or NaN somewhere
        return torch.zeros(v_bits.numel(), dtype=torch.int32), RangeFloatHeader(math.nan, 1)
    if max_bits == 0:
        return torch.zeros(v_bits.numel(), dtype=torch.int32), RangeFloatHeader(0.0, 1)
    max_abs = float(torch.tensor([max_bits], dtype=torch.int32).view(torch.float32))
    top = _floor_log2(max_abs)
    if threshold is None:
        exp_bits = _best_exponent_bits(mag_bits, top, bits)
    else:
        exp_bits = exponent_bits_for_range(max_abs, threshold, bits)
    mant_bits = bits - 1 - exp_bits
    lo = _window_base(top, exp_bits)
    # Subnormal codes: round(|v| / step) with the fixed step 2**(lo + 1 - m) (inf/garbage for
    # large |v| is harmless: it is clamped to 2**m and loses the maximum below).
    sub = (mag_bits.view(torch.float32) * 2.0 ** (mant_bits - lo - 1)).round_().to(torch.int32)
    sub.clamp_(max=1 << mant_bits)
    # Normal codes straight from the float32 bit pattern: round the mantissa to m bits (half
    # up), the carry rolls into the exponent, the exponent is rebased to lo (in place).
    shift = 23 - mant_bits
    code = mag_bits.add_((1 << (shift - 1)) - ((lo + 127) << 23)).bitwise_right_shift_(shift)
    # NOTE: branch-free merge. Inside the window (E >= 1) code >= 2**m >= the clamped sub.
    # Below it code <= sub: for E = 0, |v| = 2**lo * (1 + f) gives code = round(f * 2**m) <=
    # round((1 + f) * 2**(m - 1)) = sub; for E < 0, code <= 0 <= sub. So the maximum picks the
    # right code without a torch.where (1-2 ms on 2**20 elements here); tests check the bound.
    torch.maximum(code, sub, out=code)
    code.clamp_(max=(1 << (bits - 1)) - 1)  # saturate above the top code
    code |= (v_bits >> 31) & (1 << (bits - 1))  # sign bit
    return code, RangeFloatHeader(max_abs=max_abs, exp_bits=exp_bits)


def dequantize(codes: torch.Tensor, header: RangeFloatHeader, bits: int) -> torch.Tensor:
    """Inverse of :func:`quantize`: float32 values (all-NaN for a NaN header)."""
    n = codes.numel()
    if math.isnan(header.max_abs):
        return torch.full((n,), math.nan, dtype=torch.float32)
    if header.max_abs == 0.0:
        return torch.zeros(n, dtype=torch.float32)
    exp_bits = header.exp_bits
    mant_bits = bits - 1 - exp_bits
    lo = _window_base(_floor_log2(header.max_abs), exp_bits)
    codes = codes.to(torch.int32)
    # Read every code as a normal float f = 2**(lo + E) * (1 + mant / 2**m); for E = 0 that is
    # 2**lo + mant * 2**(lo - m), while the subnormal value is 2 * f - 2**(lo + 1) (exact by
    # Sterbenz). min(f, 2f - 2**(lo + 1)) picks the right one for every E, branch-free.
    mag_bits = (codes & ((1 << (bits - 1)) - 1)).add_((lo + 127) << mant_bits)
    normal = mag_bits.bitwise_left_shift_(23 - mant_bits).view(torch.float32)  # (n,)
    subnormal = (normal * 2.0).sub_(2.0 ** (lo + 1))
    torch.minimum(normal, subnormal, out=subnormal)
    out_bits = subnormal.view(torch.int32)
    out_bits |= (codes << (32 - bits)) & -(2**31)  # sign bit to bit 31
    return subnormal


def write_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Bit-pack ``bits``-bit codes (two's-complement int32 input) into uint8."""
    mask = (1 << bits) - 1
    return pack_bits(codes & mask, bits)


def read_codes(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`write_codes` (int32 codes)."""
    if data.storage_offset() % 2:
        # NOTE: bitpack's 16-bit path views the bytes as int16, which needs an even offset.
        data = data.clone()
    return unpack_bits(data, bits, count).to(torch.int32)


@dataclass(frozen=True)
class RangeFloatCodec:
    """Dense range-float quantization of every element (HPDC'20's value quantizer alone).

    ``bits`` in ``SUPPORTED_BITS``; 8 bits send 8 bits per element plus an 8-byte header.
    """

    NAME: ClassVar[str] = "rangefloat"
    bits: int = 8

    def __post_init__(self) -> None:
        check_bits(self.bits, owner=self.NAME)

    @property
    def spec(self) -> str:
        return f"{self.NAME}:bits={self.bits}"

    @property
    def summable(self) -> bool:
        return False

    def payload_bytes(self, numel: int) -> int:
        if numel <= 0:
            raise ConfigError(f"{self.NAME}: numel must be positive, got {numel}")
        if self.bits == 32:
            return 4 * numel
        return HEADER_BYTES + packed_bytes(numel, self.bits)

    def encode(self, grad: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        del generator  # deterministic round-to-nearest
        flat = check_gradient(grad, codec_name=self.NAME).detach().to(torch.float32)
        if self.bits == 32:
            return Payload(flat.contiguous().cpu().view(torch.uint8).clone(), flat.numel())
        codes, header = quantize(flat.cpu(), self.bits)
        data = torch.cat([header.to_bytes(), write_codes(codes, self.bits)])
        return Payload(data, flat.numel())

    def decode(self, payload: Payload) -> torch.Tensor:
        n = payload.numel
        data = payload.data
        if data.numel() != self.payload_bytes(n):
            raise ConfigError(
                f"{self.NAME}: payload has {data.numel()} bytes, expected "
                f"{self.payload_bytes(n)} for numel={n}; was it made by {self.spec}?"
            )
        if self.bits == 32:
            return data.clone().view(torch.float32)
        header = RangeFloatHeader.from_bytes(data[:HEADER_BYTES])
        codes = read_codes(data[HEADER_BYTES:], self.bits, n)
        return dequantize(codes, header, self.bits)

    def decode_sum(self, payloads: Sequence[Payload]) -> torch.Tensor:
        return sum_of_decodes(self, payloads)
