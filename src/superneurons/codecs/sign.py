"""Scaled sign compression: one bit per element plus one fp32 scale.

Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems", ICML 2018, and
Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes",
ICML 2019 (EF-signSGD), whose scaled sign ``(||g||_1 / d) * sign(g)`` this is: the scale is the
mean absolute value, so the decode has the input's L1 norm. Biased; pair with error feedback.

Wire format::

    1 float32 scale | numel sign bits, bit-packed (1 = negative; zero counts as positive)

NaN/Inf policy (project-wide): ``encode`` never raises on values; if the input holds any
non-finite value the scale is NaN and the payload decodes to all-NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from superneurons.codecs.canonical import Canonical
from superneurons.codecs.codec import Payload, check_gradient, check_payload, sum_of_decodes
from superneurons.codecs.coding.bitpack import byte_codes, pack_bits, packed_bytes
from superneurons.codecs.coding.finite import finite_flag
from superneurons.errors import ConfigError

__all__ = ["SignSGDCodec"]


@dataclass(frozen=True)
class SignSGDCodec(Canonical):
    """``mean(|g|) * sign(g)``: 1 bit per element + 4 bytes."""

    NAME: ClassVar[str] = "signsgd"

    @property
    def summable(self) -> bool:
        return False

    def payload_bytes(self, numel: int) -> int:
        if numel < 1:
            raise ConfigError(f"signsgd: numel must be >= 1, got {numel}")
        return 4 + packed_bytes(numel, 1)

    def encode(self, grad: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        flat = check_gradient(grad, codec_name=self.NAME).to(torch.float32)
        scale = flat.abs().mean()
        scale = scale * torch.where(finite_flag(flat), 1.0, math.nan)
        data = torch.empty(self.payload_bytes(flat.numel()), dtype=torch.uint8, device=flat.device)
        data[:4] = scale.reshape(1).view(torch.uint8)
        data[4:] = pack_bits(flat < 0, 1)
        return Payload(data, flat.numel())

    def decode(self, payload: Payload) -> torch.Tensor:
        numel = payload.numel
        data = check_payload(payload, nbytes=self.payload_bytes(numel), codec_name=self.NAME)
        scale = data[:4].view(torch.float32)
        # One gather over a 256-entry table: each byte decodes to its eight signs at once.
        table = (1.0 - 2.0 * byte_codes(1, data.device).to(torch.float32)) * scale  # (256, 8)
        return table.index_select(0, data[4:].to(torch.int32)).view(-1)[:numel]

    def decode_sum(self, payloads: Sequence[Payload]) -> torch.Tensor:
        return sum_of_decodes(self, payloads)
