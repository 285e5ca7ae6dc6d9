"""QSGD: stochastic quantisation of ``|g| / ||g||`` to ``levels`` uniform levels, unbiased.

Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and Encoding",
NeurIPS 2017. For each bucket of ``bucket`` consecutive elements with L2 norm ``n``, element ``g``
becomes ``n * sign(g) * l / s`` where ``l`` is ``floor(s * |g| / n)`` rounded up with probability
equal to the fractional part, so ``E[decode] = g`` (unbiased) and each element's variance is at
most ``n**2 / (4 s**2)``. The paper uses buckets of 512 elements; smaller buckets lower the
variance and cost one fp32 norm each.

Wire format (``nb = ceil(numel / bucket)``, ``b = ceil(log2(levels + 1)) + 1`` bits)::

    nb float32 norms | numel codes of b bits, bit-packed (level, then the sign in the top bit)

We skip the paper's Elias coding: the payload must have a fixed size (gloo all-gather).

NaN/Inf policy (project-wide): ``encode`` never raises on values; if the input holds any
non-finite value, every norm in the header is NaN and the payload decodes to all-NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from superneurons.compress.bitpack import pack_bits, packed_bytes, unpack_bits
from superneurons.compress.codec import (
    Payload,
    check_gradient,
    check_payload,
    finite_flag,
    sum_of_decodes,
)
from superneurons.errors import ConfigError

__all__ = ["QSGDCodec"]

_MAX_BITS = 16  # bitpack's widest code


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class QSGDCodec:
    """Unbiased stochastic quantisation to ``levels`` levels per sign, one norm per bucket.

    Args:
        levels: number of quantisation levels ``s`` (>= 1); codes take
            ``ceil(log2(levels + 1)) + 1`` bits (levels=16 -> 6 bits, levels=15 -> 5 bits).
        bucket: elements sharing one fp32 norm (>= 1); 512 as in the QSGD paper.
    """

    levels: int = 16
    bucket: int = 512

    NAME: ClassVar[str] = "qsgd"

    def __post_init__(self) -> None:
        max_levels = 2 ** (_MAX_BITS - 1) - 1
        if not _is_int(self.levels) or not 1 <= self.levels <= max_levels:
            raise ConfigError(
                f"qsgd: levels must be an integer in 1..{max_levels} (codes are at most "
                f"{_MAX_BITS} bits), got {self.levels!r}"
            )
        if not _is_int(self.bucket) or self.bucket < 1:
            raise ConfigError(
                f"qsgd: bucket (elements per norm) must be an integer >= 1, got {self.bucket!r}"
            )

    def __str__(self) -> str:  # the spec string, so str(parse_spec(s)) round-trips
        return self.spec

    @property
    def spec(self) -> str:
        return f"{self.NAME}:levels={self.levels},bucket={self.bucket}"

    @property
    def summable(self) -> bool:
        return False

    @property
    def bits(self) -> int:
        """Bits per element: level code plus one sign bit."""
        return math.ceil(math.log2(self.levels + 1)) + 1

    def _buckets(self, numel: int) -> int:
        if numel < 1:
            raise ConfigError(f"qsgd: numel must be >= 1, got {numel}")
        return -(-numel // self.bucket)

    def payload_bytes(self, numel: int) -> int:
        return 4 * self._buckets(numel) + packed_bytes(numel, self.bits)

    def encode(self, grad: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        flat = check_gradient(grad, codec_name=self.NAME).to(torch.float32)
        numel = flat.numel()
        buckets = self._buckets(numel)
        padded = torch.zeros(buckets * self.bucket, dtype=torch.float32, device=flat.device)
        padded[:numel] = flat
        rows = padded.view(buckets, self.bucket)  # (nb, bucket)
        norms = torch.linalg.vector_norm(rows, dim=1)  # (nb,)
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        scaled = rows.abs().mul_((self.levels / safe).unsqueeze(1))  # (nb, bucket), in [0, s]
        scaled.nan_to_num_(0.0, 0.0, 0.0)
        noise = torch.rand(rows.shape, generator=generator, device=rows.device)
        # level = floor(x) + [u < frac(x)] = floor(x + 1 - u) for u in [0, 1) (up to u == frac)
        level = scaled.add_(1.0).sub_(noise).floor_().clamp_(0, self.levels).to(torch.int32)
        codes = level | ((rows < 0).to(torch.int32) << (self.bits - 1))
        norms = norms * torch.where(finite_flag(flat), 1.0, math.nan)
        data = torch.cat([norms.view(torch.uint8), pack_bits(codes.view(-1)[:numel], self.bits)])
        return Payload(data, numel)

    def decode(self, payload: Payload) -> torch.Tensor:
        numel = payload.numel
        buckets = self._buckets(numel)
        data = check_payload(payload, nbytes=self.payload_bytes(numel), codec_name=self.NAME)
        norms = data[: 4 * buckets].view(torch.float32)
        codes = unpack_bits(data[4 * buckets :], self.bits, numel)
        sign_bit = 1 << (self.bits - 1)
        level = (codes & (sign_bit - 1)).to(torch.float32)
        signs = 1.0 - 2.0 * (codes >= sign_bit).to(torch.float32)
        unit = torch.zeros(buckets * self.bucket, dtype=torch.float32, device=data.device)
        unit[:numel] = level * signs / self.levels
        out = (unit.view(buckets, self.bucket) * norms.unsqueeze(1)).reshape(-1)[:numel]
        finite = torch.isfinite(norms).all()  # (buckets,): small
        return torch.where(finite, out, torch.full_like(out, math.nan))

    def decode_sum(self, payloads: Sequence[Payload]) -> torch.Tensor:
        return sum_of_decodes(self, payloads)
