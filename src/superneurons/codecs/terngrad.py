"""TernGrad: ternary gradients {-1, 0, +1} times one shared scale, 2 bits per element.

Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
Learning", NeurIPS 2017. The gradient is first clipped to ``[-c*sigma, c*sigma]`` (the paper's
``c = 2.5``), then the scale ``s = max|clipped|`` is shared by all elements and element ``g``
becomes ``s * sign(g) * b`` with ``b ~ Bernoulli(|g| / s)``: unbiased for the *clipped*
gradient, with per-element values in ``{0, s * sign(g)}``.

NOTE: sigma is the root-mean-square of the gradient (its standard deviation about zero). It
equals the standard deviation for zero-mean gradients, as the paper assumes, and unlike the
centred standard deviation it does not clip a constant gradient (or a single element) to zero.

Wire format::

    1 float32 scale | numel 2-bit codes, bit-packed (0 -> 0, 1 -> +1, 2 -> -1)

Unlike GRACE, which sends each ternary code as a whole byte, the codes are bit-packed.

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
from superneurons.codecs.codec import (
    Payload,
    check_gradient,
    check_payload,
    sum_of_decodes,
)
from superneurons.codecs.coding.bitpack import byte_codes, pack_bits, packed_bytes
from superneurons.codecs.coding.noise import uniform_one_two
from superneurons.errors import ConfigError

__all__ = ["TernGradCodec"]

_BITS = 2


@dataclass(frozen=True)
class TernGradCodec(Canonical):
    """Stochastic ternary codes with one shared fp32 scale; clipping at ``clip`` sigma.

    Args:
        clip: clipping threshold in units of the gradient's RMS (> 0; ``inf`` disables it).
    """

    clip: float = 2.5

    NAME: ClassVar[str] = "terngrad"

    def __post_init__(self) -> None:
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)):
            raise ConfigError(f"terngrad: clip must be a float > 0, got {self.clip!r}")
        if not float(self.clip) > 0.0:
            raise ConfigError(
                f"terngrad: clip is a multiple of sigma and must be > 0 (paper: 2.5; inf "
                f"disables clipping), got {self.clip}"
            )
        object.__setattr__(self, "clip", float(self.clip))

    @property
    def summable(self) -> bool:
        return False

    def payload_bytes(self, numel: int) -> int:
        if numel < 1:
            raise ConfigError(f"terngrad: numel must be >= 1, got {numel}")
        return 4 + packed_bytes(numel, _BITS)

    def clipped(self, grad: torch.Tensor) -> torch.Tensor:
        """The clipped float32 gradient whose expectation the decode matches (flat)."""
        flat = check_gradient(grad, codec_name=self.NAME).to(torch.float32)
        rms = torch.linalg.vector_norm(flat) / math.sqrt(flat.numel())
        bound = rms * self.clip if math.isfinite(self.clip) else torch.full_like(rms, math.inf)
        return flat.clamp(-bound, bound)

    def encode(self, grad: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        flat = check_gradient(grad, codec_name=self.NAME).to(torch.float32).reshape(-1)
        numel = flat.numel()
        device = flat.device
        rms = torch.linalg.vector_norm(flat) / math.sqrt(numel)
        low, high = torch.aminmax(flat)  # NaN propagates: both finite iff the input is
        scale = torch.maximum(-low, high)  # max |g|
        if math.isfinite(self.clip):
            scale = torch.minimum(scale, rms * self.clip)  # = max |clipped|
        finite = torch.isfinite(low) & torch.isfinite(high)
        factor = 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale))
        # keep ~ Bernoulli(|clipped| / scale), as QSGD with one level: v = trunc(g / scale +
        # sign(g) (1 + r)) = sign(g) (1 + keep) for r uniform on [0, 1) (noise.py's hash);
        # |g| / scale > 1 (clipped elements) saturates at |v| = 2, keep = 1 = |clipped| / scale.
        work = uniform_one_two(numel, generator=generator, device=device)
        work.copysign_(flat).addcmul_(flat, factor)
        level = work.view(torch.int32)
        level.copy_(work)  # trunc toward zero (in place: same element size)
        # code = (0b01_00_00_00_10 >> 2 (v + 2)) & 3: v = -2 -> 2 (-1), +2 -> 1 (+1), else 0
        level.clamp_(-2, 2).add_(2).mul_(2)
        table = torch.full((), 0b0100000010, dtype=torch.int32, device=device)
        torch.bitwise_right_shift(table, level, out=level).bitwise_and_(3)
        scale = scale * torch.where(finite, 1.0, math.nan)
        data = torch.empty(self.payload_bytes(numel), dtype=torch.uint8, device=device)
        data[:4] = scale.reshape(1).view(torch.uint8)
        data[4:] = pack_bits(level, _BITS)
        return Payload(data, numel)

    def decode(self, payload: Payload) -> torch.Tensor:
        numel = payload.numel
        data = check_payload(payload, nbytes=self.payload_bytes(numel), codec_name=self.NAME)
        scale = data[:4].view(torch.float32)
        # One gather over a 256-entry table: each byte decodes to its four values at once.
        codes = byte_codes(_BITS, data.device)  # (256, 4)
        # NaN scale * 0 is NaN: non-finite payloads decode to all-NaN.
        table = ((codes == 1).to(torch.float32) - (codes == 2).to(torch.float32)) * scale
        out = table.index_select(0, data[4:].to(torch.int32))  # (bytes, 4)
        return out.view(-1)[:numel]

    def decode_sum(self, payloads: Sequence[Payload]) -> torch.Tensor:
        return sum_of_decodes(self, payloads)
