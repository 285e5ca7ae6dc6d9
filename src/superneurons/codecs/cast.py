"""Cast codecs: identity (float32), fp16 and bf16 — the summable baselines.

These send every element in a narrower (or the same) floating-point type, so payloads of
several ranks can be summed element-wise by a plain all-reduce (``summable = True``). fp16
halves the bytes of float32 and is the compression PyTorch ships as ``fp16_compress_hook``;
bf16 keeps float32's exponent range with an 8-bit mantissa.

NOTE on fp16 overflow: float16's largest finite value is 65504. Summing unaveraged gradients of
P ranks in fp16 can overflow to ``inf`` even when each rank's gradient fits. Dividing by the
world size *before* the all-reduce is the DDP hook's job (PyTorch's ``fp16_compress_hook`` does
the same); the codec itself casts what it is given.

NaN/Inf policy (project-wide): ``encode`` never raises on values. Cast codecs have no shared
header, so they are element-wise: a NaN stays NaN and ±inf stays ±inf after decode (a finite
float32 above 65504 becomes ±inf in fp16). A payload made from non-finite input therefore always
decodes to a non-finite tensor, which is what ``GradScaler``-style inf checks look for. Codecs
with a shared scale (qsgd, terngrad, signsgd, topk, fft) decode such payloads to all-NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from superneurons.codecs.canonical import Canonical
from superneurons.codecs.codec import Payload, check_gradient
from superneurons.errors import ConfigError

__all__ = ["Bf16Codec", "Fp16Codec", "IdentityCodec"]


def _decode_cast(payload: Payload, wire_dtype: torch.dtype, name: str) -> torch.Tensor:
    data = payload.data
    if data.dtype != wire_dtype or data.numel() != payload.numel:
        raise ConfigError(
            f"{name}: payload must hold {payload.numel} {wire_dtype} elements, "
            f"got {data.numel()} of {data.dtype}"
        )
    return data.to(torch.float32)


def _decode_sum_cast(
    payloads: Sequence[Payload], wire_dtype: torch.dtype, name: str
) -> torch.Tensor:
    if not payloads:
        raise ConfigError(f"{name}: decode_sum needs at least one payload")
    total = _decode_cast(payloads[0], wire_dtype, name).clone()
    for payload in payloads[1:]:
        total += _decode_cast(payload, wire_dtype, name)
    return total


@dataclass(frozen=True)
class _CastCodec(Canonical):
    """Every element cast to ``WIRE_DTYPE``: summable, ``itemsize`` bytes per element."""

    NAME: ClassVar[str]
    WIRE_DTYPE: ClassVar[torch.dtype]

    @property
    def summable(self) -> bool:
        return True

    @property
    def wire_dtype(self) -> torch.dtype:
        """The payload's element type (the DDP hook encodes straight into a kept buffer)."""
        return self.WIRE_DTYPE

    def payload_bytes(self, numel: int) -> int:
        return self.WIRE_DTYPE.itemsize * numel

    def encode(self, grad: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        flat = check_gradient(grad, codec_name=self.NAME)
        # NOTE: always a fresh tensor, so callers may sum into the payload in place.
        return Payload(flat.to(self.WIRE_DTYPE, copy=True).contiguous(), flat.numel())

    def decode(self, payload: Payload) -> torch.Tensor:
        return _decode_cast(payload, self.WIRE_DTYPE, self.NAME)

    def decode_sum(self, payloads: Sequence[Payload]) -> torch.Tensor:
        return _decode_sum_cast(payloads, self.WIRE_DTYPE, self.NAME)


@dataclass(frozen=True)
class IdentityCodec(_CastCodec):
    """No compression: float32 on the wire (the dense all-reduce reference)."""

    NAME: ClassVar[str] = "identity"
    WIRE_DTYPE: ClassVar[torch.dtype] = torch.float32


@dataclass(frozen=True)
class Fp16Codec(_CastCodec):
    """IEEE half precision on the wire, 2 bytes per element (max finite 65504).

    Relative rounding error <= 2**-11 for normal values (|v| >= 2**-14); below that, an
    absolute step of 2**-24.
    """

    NAME: ClassVar[str] = "fp16"
    WIRE_DTYPE: ClassVar[torch.dtype] = torch.float16


@dataclass(frozen=True)
class Bf16Codec(_CastCodec):
    """bfloat16 on the wire, 2 bytes per element, float32's exponent range.

    Relative rounding error <= 2**-8; no overflow where float32 has none.
    """

    NAME: ClassVar[str] = "bf16"
    WIRE_DTYPE: ClassVar[torch.dtype] = torch.bfloat16
