"""The ``rangefloat`` codec: every element as an N-bit range-based float (HPDC'20's value
quantizer alone, Wang et al., arXiv 1811.08596).

The number format and its wire layout (an 8-byte header, then the codes bit-packed at ``bits``
each; ``bits = 32`` sends the raw float32 bytes) are :mod:`superneurons.codecs.coding.rangefloat`;
the NaN/Inf policy is the project's (a non-finite input decodes to all-NaN).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from superneurons.codecs.canonical import Canonical
from superneurons.codecs.codec import Payload, check_gradient, sum_of_decodes
from superneurons.codecs.coding.bitpack import packed_bytes
from superneurons.codecs.coding.rangefloat import (
    HEADER_BYTES,
    RangeFloatHeader,
    check_bits,
    quantize,
    read_values,
    write_codes,
)
from superneurons.errors import ConfigError

__all__ = ["RangeFloatCodec"]


@dataclass(frozen=True)
class RangeFloatCodec(Canonical):
    """Dense range-float quantization of every element (HPDC'20's value quantizer alone).

    ``bits`` in ``SUPPORTED_BITS``; 8 bits send 8 bits per element plus an 8-byte header.
    """

    NAME: ClassVar[str] = "rangefloat"
    bits: int = 8

    def __post_init__(self) -> None:
        check_bits(self.bits, owner=self.NAME)

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
            return Payload(flat.contiguous().view(torch.uint8).clone(), flat.numel())
        codes, header = quantize(flat, self.bits)
        data = torch.empty(self.payload_bytes(flat.numel()), dtype=torch.uint8, device=flat.device)
        data[:HEADER_BYTES] = header.to_bytes()
        if self.bits == 8:
            data[HEADER_BYTES:] = codes  # int32 -> uint8 keeps the low byte (no mask pass)
        else:
            data[HEADER_BYTES:] = write_codes(codes, self.bits)
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
        return read_values(data[HEADER_BYTES:], header, self.bits, n)

    def decode_sum(self, payloads: Sequence[Payload]) -> torch.Tensor:
        return sum_of_decodes(self, payloads)
