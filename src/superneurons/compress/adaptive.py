"""Transform-adaptive sparsification: per chunk, code in the basis that compacts it best.

The project's own codec. HPDC'20 (Wang et al., arXiv 1811.08596) sparsifies every gradient in
the Fourier domain; measured on real gradients, Top-k in the spatial domain does as well or
better once both pay the same coding (CONTEXT.md section 6), because gradients mix spatially
sparse regions (embedding rows, ReLU-gated units) with smooth or periodic ones (convolution
kernels, norms). So choose per chunk of ``L`` elements whichever orthonormal basis puts the
chunk's energy into the fewest coefficients: spatial (identity, i.e. Top-k), real Fourier or
DCT-II (:mod:`superneurons.compress.orthobases`). All three are orthonormal, so one global
selection can rank every chunk's coefficients against each other by squared magnitude.

Pipeline for ``n`` elements: pad to ``C`` chunks of even ``L`` (``L = chunk``, or ``n`` rounded
up to even when ``n < chunk``), transform every chunk in every allowed basis, pick per chunk the
basis with the smallest L1 norm of its coefficients (for equal L2 norm, the smaller L1 norm is
the more compressible vector: Donoho, "Compressed sensing", IEEE TIT 2006), keep
``k = T - floor(theta * T)`` of the ``T = C * L`` chosen coefficients and code them exactly as
``fft`` and ``ctopk`` do (:mod:`superneurons.compress.sparsecode`)::

    [basis codes, 2 bits per chunk][range-float header, 8 B][index code][k values at bits]

``scope="global"`` ranks all chunks' coefficients together (dropped energy ``<= theta`` of the
whole message); ``scope="chunk"`` keeps ``L - floor(theta * L)`` per chunk, which bounds every
chunk on its own: dropped energy ``<= theta`` of each chunk's energy (both tested, before
quantisation). ``decode_sum`` adds each rank's coefficients into one accumulator per basis (ranks
may choose different bases for a chunk) and runs one inverse per basis: linear, so the sum of
ranks' messages is decoded at the cost of one. Device-true like ``fft``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from superneurons.compress.bitpack import pack_bits, packed_bytes, unpack_bits
from superneurons.compress.codec import Payload, check_gradient, finite_flag, nan_unless
from superneurons.compress.compacttopk import check_select_index, check_theta
from superneurons.compress.orthobases import dct, fourier, inverse_dct, inverse_fourier
from superneurons.compress.rangefloat import check_bits
from superneurons.compress.sparsecode import (
    KeptLayout,
    add_kept,
    kept_count,
    pack_kept,
    select_bins,
)
from superneurons.errors import ConfigError

__all__ = ["BASES", "AdaptiveCodec", "adaptive_layout"]

BASES: tuple[str, ...] = ("spatial", "fourier", "dct")  # basis code = position here
_BASIS_BITS = 2
SCOPES: tuple[str, ...] = ("global", "chunk")
CHOICES: tuple[str, ...] = ("rd", "l1")


def adaptive_layout(numel: int, chunk: int) -> tuple[int, int]:
    """``(L, C)``: chunk length (even) and chunk count for ``numel`` elements."""
    length = chunk if numel >= chunk else numel + numel % 2
    return length, -(-numel // length)


@dataclass(frozen=True)
class AdaptiveCodec:
    """Per chunk the most compact of spatial / Fourier / DCT bases, then the ``1 - theta``
    largest coefficients, coded like ``fft`` (range-float values, compact index).

    ``theta``: fraction of coefficients dropped, in [0, 1). ``bits``: range-float width (32 =
    raw float32). ``chunk``: even chunk length. ``bases``: allowed bases joined by ``+``
    (subset of spatial, fourier, dct). ``scope``: "global" (one ranking) | "chunk" (a fixed
    share per chunk: a per-chunk error bound). ``select``/``index`` as in ``fft``.
    """

    NAME: ClassVar[str] = "adaptive"
    theta: float = 0.9
    bits: int = 8
    chunk: int = 512
    bases: str = "spatial+fourier+dct"
    scope: str = "global"
    choice: str = "rd"
    select: str = "sampled"
    index: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "theta", check_theta(self.theta, owner=self.NAME))
        check_bits(self.bits, owner=self.NAME)
        check_select_index(self.select, self.index, owner=self.NAME)
        chunk = self.chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 2 or chunk % 2:
            raise ConfigError(
                f"{self.NAME}: chunk={chunk!r} must be an even integer >= 2 (powers of two such "
                "as 512 are fastest)"
            )
        names = self.bases.split("+")
        if not names or any(b not in BASES for b in names) or len(set(names)) != len(names):
            raise ConfigError(
                f"{self.NAME}: bases={self.bases!r} must join distinct names of {list(BASES)} "
                "with '+', e.g. 'spatial+dct'"
            )
        if self.choice not in CHOICES:
            raise ConfigError(
                f"{self.NAME}: choice={self.choice!r} is unknown; use {list(CHOICES)}"
            )
        if self.scope not in SCOPES:
            raise ConfigError(f"{self.NAME}: scope={self.scope!r} is unknown; use {list(SCOPES)}")

    def __str__(self) -> str:  # the spec string, so str(parse_spec(s)) round-trips
        return self.spec

    @property
    def spec(self) -> str:
        return (
            f"{self.NAME}:theta={self.theta!r},bits={self.bits},chunk={self.chunk},"
            f"bases={self.bases},scope={self.scope},choice={self.choice},select={self.select},index={self.index}"
        )

    @property
    def summable(self) -> bool:
        return False

    def _sizes(self, numel: int) -> tuple[int, int, KeptLayout]:
        """``(L, C, layout of the kept message)``."""
        if numel <= 0:
            raise ConfigError(f"{self.NAME}: numel must be positive, got {numel}")
        length, chunks = adaptive_layout(numel, self.chunk)
        universe = chunks * length
        if self.scope == "chunk":
            kept = chunks * kept_count(length, self.theta)
        else:
            kept = kept_count(universe, self.theta)
        return length, chunks, KeptLayout(universe, kept, 1, self.bits, self.index)

    def payload_bytes(self, numel: int) -> int:
        _, chunks, layout = self._sizes(numel)
        return packed_bytes(chunks, _BASIS_BITS) + layout.nbytes

    def _basis_cost(self, candidates: list[torch.Tensor], keep_share: float) -> torch.Tensor:
        """``(3, C)``: how badly each basis codes each chunk (lower is better; disallowed
        bases get +inf).

        ``choice="rd"``: the Lagrangian of "least dropped energy for k kept coefficients":
        with a threshold ``lam`` on squared magnitude (a kept coefficient costs ``lam``, a
        dropped one its energy) a chunk costs ``sum(min(c**2, lam))``. ``lam`` is the
        ``keep_share`` quantile of the spatial coefficients' energy, from a strided sample.
        ``choice="l1"``: the L1 norm (at equal energy, the smaller is the more compressible).
        """
        allowed = self.bases.split("+")
        count = candidates[0].shape[0]
        device = candidates[0].device
        if self.choice == "rd":
            spatial = candidates[0].reshape(-1)
            sample = spatial[:: max(1, spatial.numel() // 65536)]
            rank = min(sample.numel(), max(1, round(sample.numel() * (1.0 - keep_share))))
            lam = torch.kthvalue(sample * sample, rank).values  # 0-d, on the device
        costs = []
        for name, coef in zip(BASES, candidates, strict=True):
            if name not in allowed:
                costs.append(torch.full((count,), math.inf, device=device))
            elif self.choice == "rd":
                costs.append(torch.clamp(coef * coef, max=lam).sum(dim=1))
            else:
                costs.append(torch.linalg.vector_norm(coef, ord=1, dim=1))
        return torch.stack(costs)

    def encode(self, grad: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        del generator  # deterministic
        flat = check_gradient(grad, codec_name=self.NAME).detach().to(torch.float32)
        numel = flat.numel()
        length, count, layout = self._sizes(numel)
        if count * length != numel:
            flat = torch.nn.functional.pad(flat, (0, count * length - numel))
        chunks = flat.view(count, length)  # (C, L)
        candidates = [chunks, fourier(chunks), dct(chunks)]  # 3 x (C, L), orthonormal
        cost = self._basis_cost(candidates, layout.kept / layout.universe)  # (3, C)
        basis = cost.argmin(dim=0)  # (C,) int64
        pick = basis.unsqueeze(1)  # (C, 1)
        chosen = torch.where(pick == 0, candidates[0], candidates[1])
        chosen = torch.where(pick == 2, candidates[2], chosen)  # (C, L)
        score = chosen * chosen  # (C, L)
        if self.scope == "chunk":
            per_chunk = kept_count(length, self.theta)
            top = torch.topk(score, per_chunk, dim=1, sorted=False).indices  # (C, k_c)
            offsets = torch.arange(count, device=flat.device).unsqueeze(1) * length
            indices = torch.sort((top + offsets).reshape(-1)).values  # (k,)
            mask = torch.zeros(layout.universe, dtype=torch.bool, device=flat.device)
            mask.index_fill_(0, indices, True)
        else:
            mask, indices = select_bins(score.reshape(-1), layout.kept, self.select)
        values = chosen.reshape(-1).index_select(0, indices).unsqueeze(1)  # (k, 1)
        floor = values.abs().min()
        message = pack_kept(values, mask, indices, floor, finite_flag(flat), layout)
        return Payload(torch.cat([pack_bits(basis, _BASIS_BITS), message]), numel)

    def decode(self, payload: Payload) -> torch.Tensor:
        return self.decode_sum([payload])

    def decode_sum(self, payloads: Sequence[Payload]) -> torch.Tensor:
        """Sum every rank's coefficients per basis, then one inverse transform per basis."""
        if not payloads:
            raise ConfigError(f"{self.NAME}: decode_sum needs at least one payload")
        numel = payloads[0].numel
        if any(p.numel != numel for p in payloads):
            raise ConfigError(f"{self.NAME}: decode_sum needs payloads of equal numel")
        length, count, layout = self._sizes(numel)
        head = packed_bytes(count, _BASIS_BITS)
        device = payloads[0].data.device
        per_basis = torch.zeros(len(BASES) * count, length, device=device)  # (3C, L)
        rows = torch.arange(count, device=device)
        finite = torch.ones((), dtype=torch.bool, device=device)
        for payload in payloads:
            data = payload.data
            if data.dtype != torch.uint8 or data.numel() != head + layout.nbytes:
                raise ConfigError(
                    f"{self.NAME}: payload has {data.numel()} {data.dtype} elements, expected "
                    f"{head + layout.nbytes} uint8 for numel={numel}; was it made by "
                    f"{self.spec}?"
                )
            basis = unpack_bits(data[:head], _BASIS_BITS, count).clamp_(max=len(BASES) - 1)
            coef = torch.zeros(layout.universe, 1, device=device)
            finite = finite & add_kept(coef, data[head:], layout)
            per_basis.index_add_(0, basis * count + rows, coef.view(count, length))
        spatial, fourier_coef, dct_coef = per_basis.view(len(BASES), count, length)
        signal = spatial + inverse_fourier(fourier_coef) + inverse_dct(dct_coef)  # (C, L)
        return nan_unless(finite, signal.reshape(-1)[:numel])
