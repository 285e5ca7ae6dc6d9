"""The one codec interface every gradient compressor implements.

A codec is a frozen dataclass of hyper-parameters with pure ``encode``/``decode``; anything
mutable (error-feedback residuals, PowerSGD matrices, step counters) lives in a separate state
object. The wire contract that makes codecs usable inside a DDP comm hook:

* ``encode`` turns a flat gradient into a :class:`Payload` whose byte size depends only on
  ``numel`` and the hyper-parameters, never on the values, so ranks can all-gather payloads of
  equal size without first exchanging sizes (gloo's all-gather needs equal sizes);
* every byte that travels (values, indices, scales, headers) is inside ``Payload.data``, so
  ``payload_bytes(numel) == payload.nbytes`` is the honest wire cost;
* ``summable`` codecs (identity, fp16, bf16) produce payloads that may be summed element-wise
  across ranks (all-reduce); all others are gathered and decoded with ``decode_sum``.

Two optional methods let a codec skip the full-size temporaries of a DDP step (the hook calls
them through :func:`decode_mean_into` and :func:`subtract_decode`, which fall back to the
Protocol's methods): ``decode_sum_into(payloads, out, *, divisor)`` writes ``decode_sum /
divisor`` into the caller's float32 ``out`` and ``subtract_decode_(payload, target)`` subtracts
``decode(payload)`` from ``target`` in place (error feedback's residual). Each must give the
bits of the plain composition: a sparsifier touches only its kept positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from superneurons.errors import ConfigError

__all__ = [
    "Codec",
    "Payload",
    "Specced",
    "check_gradient",
    "check_payload",
    "decode_mean_into",
    "subtract_decode",
    "sum_of_decodes",
]


@dataclass(frozen=True)
class Payload:
    """What one rank puts on the wire for one flat gradient of ``numel`` elements.

    ``data`` is 1-D and contiguous: ``uint8`` for gathered codecs, the wire dtype (e.g.
    ``float16``) for summable ones.
    """

    data: torch.Tensor
    numel: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@runtime_checkable
class Specced(Protocol):
    """What every node of a composed compression has: a canonical spec string that
    :func:`~superneurons.compress.parse_spec` parses back. Wrappers (``ErrorFeedback``,
    ``Warmup``, ``Scheduled``, ``RowSparse``) hold their ``inner`` as one;
    :func:`superneurons.schemes.compose.unwrap` checks the real types."""

    @property
    def spec(self) -> str: ...


@runtime_checkable
class Codec(Protocol):
    """A gradient compressor: frozen hyper-parameters, pure encode/decode."""

    @property
    def spec(self) -> str:
        """Canonical spec string (``fft:theta=0.9,bits=8``); ``parse_spec(spec)`` rebuilds it."""
        ...

    @property
    def summable(self) -> bool:
        """True when payloads can be summed element-wise (all-reduce) instead of gathered."""
        ...

    def payload_bytes(self, numel: int) -> int:
        """Exact bytes ``encode`` produces for a gradient of ``numel`` elements."""
        ...

    def encode(self, grad: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """Encode a 1-D floating-point gradient. ``generator`` drives stochastic rounding."""
        ...

    def decode(self, payload: Payload) -> torch.Tensor:
        """Reconstruct a float32 tensor of ``payload.numel`` elements."""
        ...

    def decode_sum(self, payloads: Sequence[Payload]) -> torch.Tensor:
        """Sum of the decodes of several ranks' payloads (may be cheaper than decoding each:
        FFT sums the sparse spectra and runs one inverse transform)."""
        ...


def sum_of_decodes(codec: Codec, payloads: Sequence[Payload]) -> torch.Tensor:
    """Reference ``decode_sum``: decode each payload and add them up (float32)."""
    if not payloads:
        raise ConfigError("decode_sum needs at least one payload")
    total = codec.decode(payloads[0]).clone()
    for payload in payloads[1:]:
        total += codec.decode(payload)
    return total


def decode_mean_into(
    codec: Codec, payloads: Sequence[Payload], out: torch.Tensor, divisor: int
) -> torch.Tensor:
    """``out = codec.decode_sum(payloads) / divisor`` (``out``: ``numel`` elements), bitwise as
    that; through the codec's ``decode_sum_into`` when it has one and ``out`` is contiguous
    float32 (no decode-sized temporary: a sparsifier writes zeros and its kept positions)."""
    into = getattr(codec, "decode_sum_into", None)
    if into is not None and out.dtype == torch.float32 and out.is_contiguous():
        return into(payloads, out, divisor=divisor)  # type: ignore[no-any-return]
    total = codec.decode_sum(payloads)
    if out.dtype == total.dtype:
        return torch.div(total, divisor, out=out)
    return out.copy_(total / divisor)


def subtract_decode(codec: Codec, payload: Payload, target: torch.Tensor) -> torch.Tensor:
    """``target -= codec.decode(payload)`` in place (contiguous float32 ``target``), bitwise as
    ``torch.sub(target, codec.decode(payload))``; a sparsifier's ``subtract_decode_`` touches
    only the kept positions."""
    own = getattr(codec, "subtract_decode_", None)
    if own is not None:
        return own(payload, target)  # type: ignore[no-any-return]
    return torch.sub(target, codec.decode(payload), out=target)


def common_numel(payloads: Sequence[Payload], *, codec_name: str) -> int:
    """The one ``numel`` every payload of a ``decode_sum`` shares (a clear error otherwise)."""
    if not payloads:
        raise ConfigError(f"{codec_name}: decode_sum needs at least one payload")
    numel = payloads[0].numel
    if any(p.numel != numel for p in payloads):
        raise ConfigError(f"{codec_name}: decode_sum needs payloads of equal numel")
    return numel


def check_gradient(grad: torch.Tensor, *, codec_name: str) -> torch.Tensor:
    """Validate an encoder input and return it as a flat tensor.

    Raises:
        ConfigError: empty, non-floating or non-1-D-viewable input.
    """
    if not isinstance(grad, torch.Tensor):
        raise ConfigError(f"{codec_name}: expected a torch.Tensor, got {type(grad).__name__}")
    if not grad.is_floating_point():
        raise ConfigError(
            f"{codec_name}: gradients must be floating point (float32/float16/bfloat16), "
            f"got {grad.dtype}; cast with .float() first"
        )
    if grad.numel() == 0:
        raise ConfigError(f"{codec_name}: cannot encode an empty tensor (numel == 0)")
    return grad.reshape(-1)


def check_payload(payload: Payload, *, nbytes: int, codec_name: str) -> torch.Tensor:
    """The payload's uint8 bytes, after checking they are the ``nbytes`` its codec produces.

    Raises:
        ConfigError: wrong dtype or size (a payload made by another codec or setting).
    """
    data = payload.data
    if data.dtype != torch.uint8 or data.numel() != nbytes:
        raise ConfigError(
            f"{codec_name}: payload for numel={payload.numel} must be {nbytes} uint8 bytes, "
            f"got {data.numel()} of {data.dtype}"
        )
    return data
