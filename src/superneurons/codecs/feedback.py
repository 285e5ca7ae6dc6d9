"""Error feedback: send what the codec dropped last time along with this step's gradient.

Seide et al., "1-Bit Stochastic Gradient Descent" (Interspeech 2014); Stich et al., "Sparsified
SGD with Memory" (NeurIPS 2018); Karimireddy et al., "Error Feedback Fixes SignSGD" (ICML 2019).
With a contractive codec C (top-k, FFT sparsification, scaled sign) the residual keeps the
dropped mass, so nothing is lost, only delayed::

    corrected = grad + residual
    payload   = C.encode(corrected)
    residual' = corrected - C.decode(payload)        # sent + residual' == corrected (fp32)

Over K steps: sum(sent_k) + residual_K == sum(grad_k) (up to float32 rounding).

Three pieces, optax-style (configuration, pure update, explicit state):

* :class:`ErrorFeedback` is the frozen *wrapper* a user composes, e.g.
  ``ErrorFeedback(Warmup(TopKCodec(ratio=0.01), steps=100))``; the DDP hook consumes it;
* :func:`feedback_step` is the pure step;
* :class:`Residuals` keeps residuals keyed by a stable string (a parameter name, never a DDP
  bucket index: DDP rebuilds buckets after the first step) with ``state_dict()``/
  ``load_state_dict()`` so resuming from a checkpoint does not lose them. A DDP bucket is a
  flat concatenation of parameters: :meth:`Residuals.step_flat` splits and joins it by
  parameter sizes (see :func:`split_flat`, :func:`join_flat`).

Non-finite policy: if the corrected gradient or its decode is not finite (a NaN/Inf gradient,
an fp16 overflow), the payload is still produced (it decodes to non-finite values, so the step
can be skipped downstream, e.g. by ``GradScaler``) but the residual is *not* updated: the old
residual is kept, so one bad step does not poison all later ones. The check is a tensor op
(``torch.where``), no host sync.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from superneurons.codecs.canonical import Canonical
from superneurons.codecs.codec import Codec, Payload, Specced, check_gradient
from superneurons.codecs.coding.finite import all_finite
from superneurons.errors import ConfigError

__all__ = ["ErrorFeedback", "Residuals", "feedback_step", "join_flat", "split_flat"]

logger = logging.getLogger("superneurons.compress")

_STATE_VERSION = 1


def feedback_step(
    codec: Codec,
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    *,
    generator: torch.Generator | None = None,
) -> tuple[Payload, torch.Tensor]:
    """One error-feedback step: ``(payload, new_residual)`` for a flat ``grad``.

    ``residual`` is the previous residual (same numel; ``None`` means zeros). The new residual
    is float32 on ``grad``'s device; it equals the old one when the step is not finite.
    """
    flat = check_gradient(grad, codec_name=codec.spec).to(torch.float32)
    if residual is None:
        previous = torch.zeros_like(flat)
    else:
        if residual.numel() != flat.numel():
            raise ConfigError(
                f"error feedback: residual has {residual.numel()} elements but the gradient "
                f"has {flat.numel()}; the model changed shape, call Residuals.reset()"
            )
        previous = residual.reshape(-1).to(device=flat.device, dtype=torch.float32)
    corrected = flat + previous
    payload = codec.encode(corrected, generator=generator)
    new_residual = corrected - codec.decode(payload)
    # NOTE: a fresh tensor either way, never an alias of the caller's residual.
    return payload, new_residual if all_finite(new_residual) else previous.clone()


def split_flat(flat: torch.Tensor, numels: Sequence[int]) -> list[torch.Tensor]:
    """Views of a flat bucket, one per parameter, in order (sizes must add up)."""
    if any(n < 0 for n in numels) or sum(numels) != flat.numel():
        raise ConfigError(
            f"split_flat: parameter sizes add up to {sum(numels)} but the bucket has "
            f"{flat.numel()} elements"
        )
    return list(torch.split(flat.reshape(-1), list(numels)))


def join_flat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-parameter tensors into one flat bucket (inverse of :func:`split_flat`)."""
    if not parts:
        raise ConfigError("join_flat needs at least one tensor")
    return torch.cat([p.reshape(-1) for p in parts])


@dataclass(frozen=True)
class ErrorFeedback(Canonical):
    """Error feedback around ``inner`` (a codec, PowerSGD, a PyTorch anchor or another wrapper).

    Spec form ``ef(INNER)``, e.g. ``ef(topk:ratio=0.01)``. The hook keeps one residual per
    parameter name (:class:`Residuals`, in ``CompressionState``) and adds it to the next
    gradient; for ``torch-powersgd`` it sets torch's ``use_error_feedback``.
    """

    inner: Specced
    NAME: ClassVar[str] = "ef"


class Residuals:
    """Residuals of error feedback around ``codec``, keyed by a stable string.

    ``codec`` may be swapped between steps (a θ schedule does this via
    :func:`superneurons.codecs.schedule.with_theta`): residuals are in gradient space, so they
    carry over. Pass ``codec=`` to one call to override it for that call only.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._residuals: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"Residuals({self.codec.spec}, keys={len(self._residuals)})"

    def keys(self) -> list[str]:
        return list(self._residuals)

    def residual(self, key: str) -> torch.Tensor | None:
        """The residual stored under ``key`` (float32, flat), or None."""
        return self._residuals.get(key)

    def reset(self) -> None:
        """Forget every residual (e.g. after the model changed shape)."""
        self._residuals.clear()

    def step(
        self,
        key: str,
        grad: torch.Tensor,
        *,
        codec: Codec | None = None,
        generator: torch.Generator | None = None,
    ) -> Payload:
        """Encode ``grad`` plus the residual under ``key``; store the new residual."""
        payload, residual = feedback_step(
            codec or self.codec, grad, self._residuals.get(key), generator=generator
        )
        self._residuals[key] = residual
        return payload

    def step_flat(
        self,
        keys: Sequence[str],
        numels: Sequence[int],
        flat: torch.Tensor,
        *,
        codec: Codec | None = None,
        generator: torch.Generator | None = None,
    ) -> Payload:
        """Error feedback on a flat bucket of several parameters, residuals kept per key.

        ``keys[i]`` names the parameter occupying ``numels[i]`` consecutive elements of ``flat``;
        the codec sees the whole bucket (one payload), the residual is split per parameter, so
        it survives DDP rebuilding its buckets with a different grouping.
        """
        if len(keys) != len(numels) or len(set(keys)) != len(keys):
            raise ConfigError("step_flat: keys must be unique and match numels one to one")
        parts = split_flat(flat, numels)
        previous: list[torch.Tensor] = []
        for key, part in zip(keys, parts, strict=True):
            stored = self._residuals.get(key)
            if stored is not None and stored.numel() != part.numel():
                raise ConfigError(
                    f"error feedback: residual {key!r} has {stored.numel()} elements, the "
                    f"parameter has {part.numel()}; call Residuals.reset()"
                )
            previous.append(
                stored
                if stored is not None
                else torch.zeros(part.numel(), dtype=torch.float32, device=flat.device)
            )
        payload, residual = feedback_step(
            codec or self.codec, flat, join_flat(previous), generator=generator
        )
        for key, part in zip(keys, split_flat(residual, numels), strict=True):
            self._residuals[key] = part.clone()
        return payload

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "codec", "residuals": {key: float32 CPU tensor}}``."""
        return {
            "version": _STATE_VERSION,
            "codec": self.codec.spec,
            "residuals": {k: v.detach().to("cpu", copy=True) for k, v in self._residuals.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore residuals saved by :meth:`state_dict` (moved to the gradient's device on use).

        A different codec spec is allowed (a θ schedule changes it) and logged.
        """
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            raise ConfigError(
                f"Residuals.load_state_dict: expected a state_dict with version "
                f"{_STATE_VERSION}, got {state.get('version') if isinstance(state, Mapping) else state!r}"
            )
        residuals = state.get("residuals")
        if not isinstance(residuals, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in residuals.items()
        ):
            raise ConfigError("Residuals.load_state_dict: 'residuals' must map str -> Tensor")
        if state.get("codec") != self.codec.spec:
            logger.info(
                "error feedback: loading residuals saved with codec %s into %s",
                state.get("codec"),
                self.codec.spec,
            )
        self._residuals = {
            k: v.detach().reshape(-1).to(torch.float32).clone() for k, v in residuals.items()
        }
