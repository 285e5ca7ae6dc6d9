"""What an optimizer-side spec names: compressed Adam, and ``auto`` under an Adam-family optimizer.

Both are productions of the one grammar (:mod:`.grammar`)::

    adam-momentum[warmup=N,wire=SPEC,clip=RMS]:CODEC    1-bit Adam (Tang et al., ICML 2021)
    adam-update[warmup=N,wire=SPEC,clip=RMS]:CODEC      averaged local AdamW updates
    auto[:link=RATE,latency=T,margin=F]                 with --optimizer adam/adamw only

The first two configure :class:`~superneurons.optim.adam.CompressedAdamW` (``kwargs()``); the
last is :func:`~superneurons.optim.autoadam.decide_adam_scheme`'s config. Their canonical form
writes only the options that differ from their defaults (``adam-momentum[warmup=20,wire=fp16]:
signsgd``, ``auto:link=100mbit``): the strings runs have always recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from superneurons.codecs.canonical import Canonical
from superneurons.codecs.codec import Codec
from superneurons.codecs.twophase import TwoPhase
from superneurons.errors import ConfigError

__all__ = [
    "DEFAULT_LATENCY_NS",
    "DEFAULT_MARGIN",
    "AdamAuto",
    "AdamMomentum",
    "AdamScheme",
    "AdamUpdate",
]

# NOTE: 1-bit Adam ran up to ~40% above its predicted step here (char-GPT, 100 Mbit/s), and a
# 9% predicted gain was a 1.26x loss: choose it only when predicted >= 20% faster.
DEFAULT_MARGIN = 0.2

# A stated link's latency per message step when none is stated: the 2-rank all-reduce line the
# network benchmark fitted between two namespaces on a veth pair shaped to 1 Gbit/s, gloo, one
# thread per rank (benchmarks/results/nproc/network-1gbit/network.json, the 2-rank ``auto``
# record: alpha = 88.9 us per call), over the 2 message steps of a 2-rank ring all-reduce.
DEFAULT_LATENCY_NS = 44_000


@dataclass(frozen=True)
class _CompressedAdam(Canonical):
    """``NAME[warmup=N,wire=SPEC,clip=RMS]:CODEC``: the keyword arguments of
    :class:`~superneurons.optim.adam.CompressedAdamW` besides AdamW's hyper-parameters.

    Args:
        inner: the codec of the momentum (or update), or :class:`TwoPhase` (the two-phase
            quantised all-reduce); error feedback is always on.
        warmup_steps: the first steps average gradients (momentum) or updates through ``wire``.
        wire: a summable codec for the warm-up (``fp16``, ``bf16``); None: fp32.
        clip_rms: momentum mode: clip each tensor's frozen-variance direction to this RMS.
    """

    inner: Codec | TwoPhase
    warmup_steps: int = field(default=0, metadata={"key": "warmup"})
    wire: Codec | None = None
    clip_rms: float | None = field(default=None, metadata={"key": "clip"})
    NAME: ClassVar[str]
    BRACKETS: ClassVar[bool] = True
    SPEC_DEFAULTS: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Codec | TwoPhase):
            raise ConfigError(
                f"{self.NAME}: the part after ':' must be a codec or twophase, got {self.inner}"
            )
        steps = self.warmup_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError(f"{self.NAME}: warmup must be an integer >= 0, got {steps!r}")
        if self.wire is not None and not (isinstance(self.wire, Codec) and self.wire.summable):
            raise ConfigError(
                f"{self.NAME}: wire must be a summable codec (fp16, bf16, identity), got {self.wire}"
            )
        if self.clip_rms is not None and not self.clip_rms > 0:
            raise ConfigError(f"{self.NAME}: clip must be > 0, got {self.clip_rms}")

    @property
    def mode(self) -> str:
        """``"momentum"`` or ``"update"`` (:data:`superneurons.optim.adam.MODES`)."""
        return self.NAME.removeprefix("adam-")

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``CompressedAdamW`` this scheme sets."""
        return {
            "mode": self.mode,
            "codec": self.inner,
            "warmup_steps": self.warmup_steps,
            "warmup_codec": self.wire,
            "clip_rms": self.clip_rms,
        }


@dataclass(frozen=True)
class AdamMomentum(_CompressedAdam):
    """1-bit Adam: a dense warm-up, then compressed momentum over the frozen second moment."""

    NAME: ClassVar[str] = "adam-momentum"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.warmup_steps < 1:
            raise ConfigError(
                "adam-momentum freezes Adam's second moment after a dense warm-up: set "
                "warmup >= 1 (about 10% of the run; 20 of 200 steps on the char-GPT), e.g. "
                "adam-momentum[warmup=20,wire=fp16]:signsgd"
            )


@dataclass(frozen=True)
class AdamUpdate(_CompressedAdam):
    """Every rank keeps its own moments; the local AdamW updates are averaged, compressed."""

    NAME: ClassVar[str] = "adam-update"


AdamScheme = AdamMomentum | AdamUpdate


@dataclass(frozen=True)
class AdamAuto(Canonical):
    """``auto[:link=RATE,latency=T,margin=F]`` under an Adam-family optimizer.

    Args:
        link_bit_s: plan for a link of this rate (bits per second, written ``link=100mbit``)
            instead of the measured network (nothing of the network is measured then); None:
            the measured one.
        margin: 1-bit Adam is chosen only when its predicted mean step is at least this
            fraction faster than dense's.
        latency_ns: the stated link's latency per message step (written ``latency=50us``;
            a ring all-reduce takes ``2(P-1)`` steps, an all-gather ``P-1``): by default
            :data:`DEFAULT_LATENCY_NS`; only with ``link``.
        warmup_fraction, min_warmup_steps: 1-bit Adam's warm-up is
            ``max(min_warmup_steps, ceil(warmup_fraction * total_steps))`` (10% and 20 steps:
            a 10-step warm-up diverged on the char-GPT); not options of the spec.
    """

    link_bit_s: int | None = field(default=None, metadata={"key": "link", "rate": True})
    margin: float = DEFAULT_MARGIN
    latency_ns: int = field(
        default=DEFAULT_LATENCY_NS, metadata={"key": "latency", "duration": True}
    )
    warmup_fraction: float = field(default=0.1, metadata={"option": False})
    min_warmup_steps: int = field(default=20, metadata={"option": False})
    NAME: ClassVar[str] = "auto"
    SPEC_DEFAULTS: ClassVar[bool] = False
    SPEC_HINT: ClassVar[str] = (
        "with an Adam-family optimizer, auto chooses between dense AdamW and 1-bit Adam; "
        "gradient-codec options apply with --optimizer sgd"
    )

    def __post_init__(self) -> None:
        if self.link_bit_s is not None and self.link_bit_s <= 0:
            raise ConfigError(f"auto: link must be > 0 bit/s, got {self.link_bit_s}")
        latency = self.latency_ns
        if isinstance(latency, bool) or not isinstance(latency, int) or latency < 0:
            raise ConfigError(f"auto: latency must be >= 0 ns, got {latency!r}")
        if self.link_bit_s is None and latency != DEFAULT_LATENCY_NS:
            raise ConfigError(
                "auto: latency= is the stated link's: state its rate too, e.g. "
                "auto:link=1gbit,latency=50us"
            )
        if not 0.0 <= self.margin < 1.0:
            raise ConfigError(f"auto: margin must be in [0, 1), got {self.margin}")
        if not 0.0 < self.warmup_fraction < 1.0 or self.min_warmup_steps < 1:
            raise ConfigError("auto: warmup_fraction in (0, 1) and min_warmup_steps >= 1")
