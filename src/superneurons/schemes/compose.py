"""What ``register_compression`` accepts, and what its wrappers ask the hook to do.

A *compression* is a base reduction (a codec, :class:`PowerSGD`, one of PyTorch's anchors or
:class:`Auto`) inside any number of wrappers (:class:`ErrorFeedback`, :class:`Warmup`,
:class:`Scheduled`, :class:`RowSparse`), e.g. ``ErrorFeedback(Warmup(TopKCodec(), steps=100))``.
:func:`unwrap` flattens it into a :class:`Pipeline`, the one thing the hook reads. The order of
wrappers does not change the behaviour: warm-up steps are plain fp32 averaging (lossless, so
there is nothing to feed back), error feedback applies to every compressed step.

:func:`compose` is the CLI's edge: ``--compress`` plus the flags ``--no-error-feedback`` and
``--warmup-steps`` become one object. A plain spec string given to ``register_compression``
gets the defaults of :func:`with_defaults` (error feedback on, as before).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from superneurons.codecs.cast import IdentityCodec
from superneurons.codecs.codec import Codec
from superneurons.codecs.feedback import ErrorFeedback
from superneurons.codecs.powersgd import PowerSGD
from superneurons.codecs.rowsparse import RowSparse
from superneurons.codecs.schedule import Scheduled, ThetaSchedule, Warmup, with_theta
from superneurons.codecs.twophase import TwoPhase
from superneurons.errors import ConfigError
from superneurons.schemes.anchors import TorchAnchor, TorchDense, TorchFp16
from superneurons.schemes.auto import Auto
from superneurons.schemes.grammar import Base, Compression, parse_spec

__all__ = ["Base", "Compression", "Pipeline", "compose", "defaulted", "unwrap", "with_defaults"]


@dataclass(frozen=True)
class Pipeline:
    """A compression flattened for the hook: the base and what the wrappers switch on."""

    base: Base
    error_feedback: bool = False
    warmup_steps: int = 0
    schedule: ThetaSchedule | None = None
    row_sparse: bool = False

    @property
    def codec(self) -> Codec | None:
        """The base when it is a codec (encode/decode), else None."""
        return None if isinstance(self.base, (PowerSGD, TwoPhase, TorchAnchor, Auto)) else self.base


def unwrap(compression: Compression) -> Pipeline:
    """Flatten the wrappers of ``compression`` (validated: a schedule needs a θ to drive)."""
    error_feedback, warmup, schedule, row_sparse = False, 0, None, False
    node: object = compression
    while isinstance(node, (ErrorFeedback, Warmup, Scheduled, RowSparse)):
        if isinstance(node, ErrorFeedback):
            error_feedback = True
        elif isinstance(node, Warmup):
            warmup = max(warmup, node.steps)
        elif isinstance(node, Scheduled):
            if schedule is not None:
                raise ConfigError("only one θ schedule per compression")
            schedule = node.schedule
        else:
            row_sparse = True
        node = node.inner
    if not hasattr(node, "spec") or not hasattr(node, "summable"):
        raise ConfigError(
            f"{compression!r} is not a compression: give a codec, PowerSGD, a PyTorch anchor, "
            "Auto, wrappers around one, or a spec string such as 'fft:theta=0.9,bits=8'"
        )
    base: Base = node  # type: ignore[assignment]
    if schedule is not None:
        if isinstance(base, (PowerSGD, TwoPhase, TorchAnchor, Auto)):
            raise ConfigError(f"{base.spec} has no θ to schedule; use fft or topk")
        with_theta(base, 0.5)  # raises ConfigError for codecs without a θ
    if isinstance(base, Auto) and row_sparse:
        raise ConfigError("auto decides per bucket itself; do not wrap it in rowsparse(...)")
    return Pipeline(base, error_feedback, warmup, schedule, row_sparse)


def with_defaults(compression: Compression) -> Compression:
    """Error feedback around ``compression`` unless it has it or cannot use it (lossless
    ``identity``, ``dense``, ``torch-fp16`` whose hook has no residual)."""
    return defaulted(compression, unwrap(compression))[0]


def defaulted(compression: Compression, pipeline: Pipeline) -> tuple[Compression, Pipeline]:
    """:func:`with_defaults` of ``compression`` whose ``pipeline`` is known, and its pipeline."""
    if pipeline.error_feedback or isinstance(pipeline.base, (IdentityCodec, TorchDense, TorchFp16)):
        return compression, pipeline
    return ErrorFeedback(compression), replace(pipeline, error_feedback=True)


def compose(
    spec: Compression | str, *, error_feedback: bool = True, warmup_steps: int = 0
) -> Compression:
    """The CLI's flags as one object: ``ErrorFeedback(Warmup(parse_spec(spec), steps=N))``.

    ``spec``: a compression, or a spec string (parsed here). ``error_feedback=False`` leaves
    feedback out unless the spec itself wraps it in ``ef(...)``.
    """
    compression = parse_spec(spec) if isinstance(spec, str) else spec
    if warmup_steps:
        compression = Warmup(compression, steps=warmup_steps)
    if error_feedback:
        compression = with_defaults(compression)
    return compression
