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

from superneurons.codecs.canonical import Canonical
from superneurons.codecs.codec import Payload, check_gradient, check_payload, sum_of_decodes
from superneurons.codecs.coding.bitpack import (
    pack_bits,
    pack_sextets,
    packed_bytes,
    unpack_bits,
    unpack_sextets,
)
from superneurons.codecs.coding.finite import finite_flag
from superneurons.codecs.coding.noise import uniform_one_two
from superneurons.errors import ConfigError

__all__ = ["QSGDCodec"]

_MAX_BITS = 16  # bitpack's widest code


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class QSGDCodec(Canonical):
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
        padded = buckets * self.bucket
        device = flat.device
        # NOTE: few full-size buffers, everything in place: on one CPU thread each fresh 4 MiB
        # temporary costs page faults comparable to the arithmetic on it.
        if padded == numel:
            rows = flat.reshape(buckets, self.bucket)
        else:
            rows = torch.zeros(padded, dtype=torch.float32, device=device)
            rows[:numel] = flat
            rows = rows.view(buckets, self.bucket)
        norms = torch.linalg.vector_norm(rows, dim=1)  # (nb,)
        factor = torch.where(norms > 0, self.levels / norms, 0.0).unsqueeze(1)  # (nb, 1)
        data = torch.empty(self.payload_bytes(numel), dtype=torch.uint8, device=device)
        data[: 4 * buckets] = (norms * torch.where(finite_flag(flat), 1.0, math.nan)).view(
            torch.uint8
        )
        # level = floor(x + r) for x = s |g| / n in [0, s] and r uniform on [0, 1): floor(x) + 1
        # with probability frac(x), so E[level] = x (unbiased). Computed in one buffer, in place,
        # as v = trunc(g s / n + sign(g) (1 + r)) = sign(g) (level + 1), r from a seeded
        # counter-based hash (noise.py) instead of torch.rand (~2x cheaper on one CPU thread).
        work = uniform_one_two(padded, generator=generator, device=device).view(rows.shape)
        work.copysign_(rows).addcmul_(rows, factor)
        level = work.view(torch.int32)
        level.copy_(work)  # trunc toward zero (in place: same element size)
        # NaN/inf (non-finite input) converts to garbage: the clamp makes it a valid code.
        level.clamp_(-(self.levels + 1), self.levels + 1).add_(self.levels + 1)  # v + s + 1
        # code of v: |v| - 1, with the sign in the top bit (v = 0 only from garbage: code 0)
        signed = torch.arange(-(self.levels + 1), self.levels + 2, device=device)  # (2s + 3,)
        table = (signed.abs() - 1).clamp_(min=0) | (signed < 0).to(torch.int64) << self.bits - 1
        if self.bits == 6 and padded % 4 == 0:
            codes = table.to(torch.uint8).index_select(0, level.view(-1))  # (padded,)
            if padded == numel:
                pack_sextets(codes, out=data[4 * buckets :], scratch=level)
            else:
                body = torch.empty(3 * padded // 4, dtype=torch.uint8, device=device)
                pack_sextets(codes, out=body, scratch=level)
                data[4 * buckets :] = body[: data.numel() - 4 * buckets]
        else:
            codes = table.to(torch.int32).index_select(0, level.view(-1)[:numel])
            data[4 * buckets :] = pack_bits(codes, self.bits)
        return Payload(data, numel)

    def decode(self, payload: Payload) -> torch.Tensor:
        numel = payload.numel
        buckets = self._buckets(numel)
        padded = buckets * self.bucket
        data = check_payload(payload, nbytes=self.payload_bytes(numel), codec_name=self.NAME)
        norms = data[: 4 * buckets].view(torch.float32)
        # all-NaN unless every norm is finite, folded into the per-bucket step norm / s
        step = norms * torch.where(torch.isfinite(norms.amax()), 1.0 / self.levels, math.nan)
        if self.bits == 6 and padded % 4 == 0:
            body = data[4 * buckets :]
            if padded > numel:  # the zero codes of the padding
                body = torch.cat([body, body.new_zeros(3 * padded // 4 - body.numel())])
            codes = unpack_sextets(body, padded)  # (padded,) uint8
        else:
            codes = torch.zeros(
                padded, dtype=torch.uint8 if self.bits <= 8 else torch.int32, device=data.device
            )
            codes[:numel] = unpack_bits(data[4 * buckets :], self.bits, numel)
        # sign-magnitude -> two's complement in place: (l ^ -s) - (-s)
        signs = torch.bitwise_right_shift(codes, self.bits - 1)  # (padded,) 0/1
        signs.neg_()  # 0 or all ones
        codes.bitwise_and_((1 << (self.bits - 1)) - 1).bitwise_xor_(signs).sub_(signs)
        signed = codes.view(torch.int8) if self.bits <= 8 else codes
        out = torch.empty(buckets, self.bucket, dtype=torch.float32, device=data.device)
        out.copy_(signed.view(buckets, self.bucket)).mul_(step.unsqueeze(1))
        return out.view(-1)[:numel]

    def decode_sum(self, payloads: Sequence[Payload]) -> torch.Tensor:
        return sum_of_decodes(self, payloads)
