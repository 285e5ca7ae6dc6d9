"""The two-phase compressed all-reduce's configuration and its data-free layout.

Every gradient codec that sparsifies (``fft``, ``topk``, ``ctopk``, ``adaptive``) is
all-gathered: each rank receives ``(P - 1)`` payloads, so its bytes and its decode work grow
with the number of ranks P. A two-phase all-reduce keeps both independent of P (DeepSpeed's
compressed back-end of 1-bit Adam, Tang et al., ICML'21; CGX, Markov et al., Middleware'22;
torchft's ``allreduce_quantized``):

1. every rank adds its error-feedback residual, optionally applies a shared orthogonal
   transform (:mod:`.coding.orthogonal`), quantises with per-chunk scales
   (:mod:`.coding.chunkquant`) and keeps the new residual; the gradient is cut into P
   slices and slice ``j`` goes to rank ``j`` (one all-to-all);
2. rank ``j`` (the slice's *owner*) decodes the P copies of its slice, averages them in
   fp32, adds its own residual, re-quantises, keeps that residual, and every rank receives
   every owner's slice (one all-gather); a shared transform is undone after the average.

Each rank sends and receives about ``2 (P - 1)/P · n · b/8`` bytes for ``n`` values at ``b``
bits, plus one fp32 scale per chunk; a ring all-reduce of bf16 moves ``4 (P - 1)/P · n``.

Layout (a pure function of ``numel``, P and the config, so every rank agrees without
exchanging sizes): a gradient of ``numel`` values is zero-padded to ``P · slice_numel``;
``slice_numel`` is ``ceil(numel / P)`` rounded up to whole chunks of ``cols`` values
(``cols = chunk``, or one smaller chunk when the slice is shorter than ``chunk``: a power of
two for the Hadamard transform, a multiple of 8 otherwise, so a slice's codes end on a byte).
One slice travels as ``rows`` fp32 scales then ``slice_numel`` packed codes, padded to 4
bytes (:attr:`SliceLayout.slice_bytes`). ``bits=32`` sends the fp32 values themselves: a
lossless reduce-scatter + all-gather, the reference the quantised settings are checked
against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from superneurons.codecs.canonical import Canonical
from superneurons.codecs.coding.chunkquant import quantized_bytes
from superneurons.errors import ConfigError

__all__ = ["TWOPHASE_BITS", "SliceLayout", "TwoPhase"]

TWOPHASE_BITS = (1, 2, 4, 8, 32)
_MAX_CHUNK = 2**16


def _align4(nbytes: int) -> int:
    return -(-nbytes // 4) * 4


@dataclass(frozen=True)
class SliceLayout:
    """How one gradient of ``numel`` values is cut into ``world_size`` slices (see module)."""

    numel: int
    world_size: int
    slice_numel: int
    cols: int  # values per chunk (one fp32 scale each)
    bits: int

    @property
    def rows(self) -> int:
        """Chunks per slice."""
        return self.slice_numel // self.cols

    @property
    def padded_numel(self) -> int:
        return self.world_size * self.slice_numel

    @property
    def slice_bytes(self) -> int:
        """Bytes of one slice on the wire (4-byte aligned: the scales are read as fp32)."""
        if self.bits == 32:
            return 4 * self.slice_numel
        return _align4(quantized_bytes(self.rows, self.cols, self.bits))


@dataclass(frozen=True)
class TwoPhase(Canonical):
    """Two-phase compressed all-reduce: ``bits``-bit codes with one fp32 scale per ``chunk``
    values, exchanged by all-to-all, re-quantised by each slice's owner, then all-gathered.

    Args:
        bits: 1 (scaled sign), 2, 4 or 8 bits per value; 32 sends fp32 (lossless).
        chunk: values sharing one scale (a multiple of 8; a power of two with ``hadamard``);
            512 as CGX's buckets.
        rounding: ``nearest`` (deterministic) or ``stochastic`` (unbiased).
        transform: ``none``, ``hadamard`` (randomized Walsh-Hadamard) or ``dct``
            (randomized DCT-II), applied per chunk before quantising, seeded and shared.
    """

    bits: int = 4
    chunk: int = 512
    rounding: str = "nearest"  # nearest | stochastic
    transform: str = "none"  # none | hadamard | dct
    NAME: ClassVar[str] = "twophase"

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in TWOPHASE_BITS:
            raise ConfigError(f"twophase: bits must be one of {TWOPHASE_BITS}, got {self.bits!r}")
        chunk = self.chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 8 <= chunk <= _MAX_CHUNK:
            raise ConfigError(
                f"twophase: chunk must be an integer in 8..{_MAX_CHUNK}, got {chunk!r}"
            )
        if chunk % 8:
            raise ConfigError(f"twophase: chunk must be a multiple of 8, got {chunk}")
        if self.transform == "hadamard" and chunk & (chunk - 1):
            raise ConfigError(
                f"twophase: transform=hadamard needs a power-of-two chunk (256, 512, ...), "
                f"got {chunk}"
            )
        if self.rounding not in ("nearest", "stochastic"):
            raise ConfigError(
                f"twophase: rounding must be nearest or stochastic, got {self.rounding!r}"
            )
        if self.transform not in ("none", "hadamard", "dct"):
            raise ConfigError(
                f"twophase: transform must be none, hadamard or dct, got {self.transform!r}"
            )

    @property
    def summable(self) -> bool:
        """Aggregated (averaged on the way), not gathered: decode work independent of P."""
        return True

    def layout(self, numel: int, world_size: int) -> SliceLayout:
        """The slices of a gradient of ``numel`` values over ``world_size`` ranks."""
        if numel < 1 or world_size < 1:
            raise ConfigError(
                f"twophase: numel and world_size must be >= 1, got {numel}, {world_size}"
            )
        per = -(-numel // world_size)
        if per >= self.chunk:
            cols = self.chunk
            slice_numel = -(-per // cols) * cols
        else:
            if self.transform == "hadamard":
                cols = 1 << (max(per, 8) - 1).bit_length()  # the next power of two >= 8
            else:
                cols = -(-per // 8) * 8
            slice_numel = cols
        return SliceLayout(numel, world_size, slice_numel, cols, self.bits)

    def message_bytes(self, numels: list[int] | tuple[int, ...], world_size: int) -> int:
        """Bytes of one rank's segment (for each slice owner) of gradients of ``numels``: the
        all-gather sends one segment, the all-to-all ``world_size`` of them."""
        return sum(self.layout(n, world_size).slice_bytes for n in numels)
