"""Gradient compression: codecs, error feedback, θ schedules and the DDP comm hook.

The public import path of four packages, lowest first: :mod:`superneurons.codecs` (pure:
config -> bytes), :mod:`superneurons.schemes` (the spec grammar and what it names),
:mod:`superneurons.ddp` (the comm hook and everything that touches a process group) and
:mod:`superneurons.optim` (1-bit Adam); ``auto``'s decisions are :mod:`superneurons.strategy`.

The codec interface is :class:`Codec` (frozen hyper-parameters, pure ``encode``/``decode``,
exact ``payload_bytes``); codecs are named by spec strings (``parse_spec("fft:theta=0.9")``).
The paper's codec is HPDC'20's FFT sparsification with range-based floats (:class:`FFTCodec`);
the rest are the baselines it is compared against. Importing this package starts nothing.
"""

from __future__ import annotations

from superneurons.codecs.adaptive import AdaptiveCodec
from superneurons.codecs.cast import Bf16Codec, Fp16Codec, IdentityCodec
from superneurons.codecs.codec import Codec, Payload, check_gradient, sum_of_decodes
from superneurons.codecs.feedback import (
    ErrorFeedback,
    Residuals,
    feedback_step,
    join_flat,
    split_flat,
)
from superneurons.codecs.powersgd import PowerSGD
from superneurons.codecs.qsgd import QSGDCodec
from superneurons.codecs.rangefloat import RangeFloatCodec
from superneurons.codecs.rowsparse import RowSparse
from superneurons.codecs.schedule import (
    ConstantTheta,
    DiminishingTheta,
    ErrorBudgetTheta,
    Scheduled,
    ScheduleState,
    Warmup,
    sparsification_error,
    with_theta,
)
from superneurons.codecs.sign import SignSGDCodec
from superneurons.codecs.sparse.compacttopk import CompactTopKCodec
from superneurons.codecs.sparse.fft import FFTCodec
from superneurons.codecs.sparse.topk import TopKCodec
from superneurons.codecs.terngrad import TernGradCodec
from superneurons.codecs.twophase import TwoPhase
from superneurons.ddp.deferred import DeferredCompression, deferred_compression_hook
from superneurons.ddp.hook import CompressionState, register_compression
from superneurons.ddp.local import register_local_gradients
from superneurons.optim.adam import CompressedAdamW
from superneurons.schemes.anchors import TorchDense, TorchFp16, TorchPowerSGD
from superneurons.schemes.auto import Auto
from superneurons.schemes.compose import Compression, compose
from superneurons.schemes.grammar import CODECS, SPECS, describe_codecs, parse_spec

__all__ = [
    # optimizer-side compression for AdamW (1-bit Adam style)
    "CompressedAdamW",
    "register_local_gradients",
    # the codec interface
    "Codec",
    "Payload",
    "check_gradient",
    "sum_of_decodes",
    # codecs: the paper's (HPDC'20) ...
    "FFTCodec",
    "RangeFloatCodec",
    # ... ours: the transform-adaptive codec and the equally coded Top-k baseline
    "AdaptiveCodec",
    "CompactTopKCodec",
    # ... and the baselines
    "Bf16Codec",
    "Fp16Codec",
    "IdentityCodec",
    "PowerSGD",
    "QSGDCodec",
    "SignSGDCodec",
    "TernGradCodec",
    "TopKCodec",
    # the two-phase quantised all-reduce (bytes per rank independent of the world size)
    "TwoPhase",
    # PyTorch's own reductions (anchors) and the per-bucket choice
    "Auto",
    "TorchDense",
    "TorchFp16",
    "TorchPowerSGD",
    # spec strings: one grammar, one table
    "CODECS",
    "SPECS",
    "describe_codecs",
    "parse_spec",
    # wrappers the hook consumes, and the CLI flags as one object
    "Compression",
    "ErrorFeedback",
    "RowSparse",
    "Scheduled",
    "Warmup",
    "compose",
    # error feedback state
    "Residuals",
    "feedback_step",
    "join_flat",
    "split_flat",
    # θ schedules
    "ConstantTheta",
    "DiminishingTheta",
    "ErrorBudgetTheta",
    "ScheduleState",
    "sparsification_error",
    "with_theta",
    # the DDP comm hook
    "CompressionState",
    "DeferredCompression",
    "deferred_compression_hook",
    "register_compression",
]
