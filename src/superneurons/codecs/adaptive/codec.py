"""Transform-adaptive sparsification: per chunk, code in the basis that compacts it best.

The project's own codec. HPDC'20 (Wang et al., arXiv 1811.08596) sparsifies every gradient in
the Fourier domain; measured on real gradients, Top-k in the spatial domain does as well or
better once both pay the same coding (benchmarks/results/codecs/README.md), because gradients mix spatially
sparse regions (embedding rows, ReLU-gated units) with smooth or periodic ones (convolution
kernels, norms). So choose per chunk of ``L`` elements whichever orthonormal basis puts the
chunk's energy into the fewest coefficients: spatial (identity, i.e. Top-k), real Fourier or
DCT-II (:mod:`.bases`). All three are orthonormal, so one global
selection can rank every chunk's coefficients against each other by squared magnitude.

Pipeline for ``n`` elements: pad to ``C`` chunks of even ``L`` (``L = chunk``, or ``n`` rounded
up to even when ``n < chunk``), transform every chunk in every allowed basis, pick per chunk the
basis with the least Lagrangian cost ``sum(min(c**2, lam))`` (``choice="rd"``, ``lam`` the kept
share's quantile of the input's energy; ``choice="l1"``: the smallest L1 norm, which for equal
L2 norm is the more compressible vector: Donoho, "Compressed sensing", IEEE TIT 2006;
``margin`` makes a transform beat the spatial cost by that share), keep
``k = T - floor(theta * T)`` of the ``T = C * L`` chosen coefficients and code them exactly as
``fft`` and ``ctopk`` do (:mod:`superneurons.codecs.coding.sparsecode`). ``header="fixed"``::

    [basis codes, 2 bits per chunk][range-float header, 8 B][index code][k values at bits]

``header="sparse"`` (opt-in, :mod:`.switches`) names only the
switched chunks and fills the fixed payload with coefficients; the encoder keeps the switches
only if they lower the message's squared error (quantisation included). Its sizes follow from
a count read on the host (a GPU synchronisation per encode and payload decoded), and it encodes
~1.4x slower, for ~0.2% less error after error feedback (benchmarks/results/codecs/README.md), so ``fixed`` is the
default: it runs with no host read on any device.

``scope="global"`` ranks all chunks' coefficients together (dropped energy ``<= theta`` of the
whole message); ``scope="chunk"`` keeps ``L - floor(theta * L)`` per chunk, which bounds every
chunk on its own: dropped energy ``<= theta`` of each chunk's energy (both tested, before
quantisation). ``decode_sum`` adds each rank's coefficients into one accumulator per basis (ranks
may choose different bases for a chunk) and runs one inverse per basis: linear, so the sum of
ranks' messages is decoded at the cost of one. Device-true like ``fft``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from superneurons.codecs.adaptive.bases import (
    BASES,
    dct,
    fourier,
    gather_flat,
    inverse_dct,
    inverse_fourier,
    inverse_rows,
    pick_rows,
    spectrum_buffer,
    sync_free,
)
from superneurons.codecs.adaptive.switches import (
    COUNT_BYTES,
    SwitchLayout,
    choose_switches,
    encode_switches,
    read_basis,
    relative_error,
)
from superneurons.codecs.canonical import Canonical
from superneurons.codecs.codec import Payload, check_gradient, common_numel
from superneurons.codecs.coding.bitpack import pack_bits, packed_bytes, unpack_bits
from superneurons.codecs.coding.finite import finite_flag, nan_unless
from superneurons.codecs.coding.rangefloat import check_bits
from superneurons.codecs.coding.sparsecode import (
    KeptLayout,
    add_kept,
    check_select_index,
    check_theta,
    kept_count,
    kth_smallest,
    pack_kept,
    select_indices,
)
from superneurons.codecs.coding.workspace import workspace
from superneurons.errors import ConfigError

__all__ = ["AdaptiveCodec", "adaptive_layout"]

_BASIS_BITS = 2
SCOPES: tuple[str, ...] = ("global", "chunk")
CHOICES: tuple[str, ...] = ("rd", "l1")
HEADERS: tuple[str, ...] = ("sparse", "fixed")
_Kept = tuple[
    torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor
]  # values, mask, ids, floor
_LAMBDA_SAMPLE = 65536  # strided input samples that set the Lagrangian threshold (choice="rd")


def adaptive_layout(numel: int, chunk: int) -> tuple[int, int]:
    """``(L, C)``: chunk length (even) and chunk count for ``numel`` elements."""
    length = chunk if numel >= chunk else numel + numel % 2
    return length, -(-numel // length)


@dataclass(frozen=True)
class AdaptiveCodec(Canonical):
    """Per chunk the most compact of spatial / Fourier / DCT bases, then the ``1 - theta``
    largest coefficients, coded like ``fft`` (range-float values, compact index).

    ``theta``: fraction of coefficients dropped, in [0, 1). ``bits``: range-float width (32 =
    raw float32). ``chunk``: even chunk length. ``bases``: allowed bases joined by ``+``
    (subset of spatial, fourier, dct). ``scope``: "global" (one ranking) | "chunk" (a fixed
    share per chunk: a per-chunk error bound). ``choice``: "rd" | "l1" basis cost.
    ``select``/``index`` as in ``fft``. ``margin`` in [0, 1): share by which a transform must
    beat the spatial basis' cost (0: none; measured worse after error feedback,
    benchmarks/results/codecs/README.md).
    ``header``: "fixed" (default: 2 bits per chunk, no host read, needed by ``scope="chunk"``)
    | "sparse" (switched chunks only, variable kept count in a fixed payload; one host read).
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
    margin: float = 0.0
    header: str = "fixed"

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
        margin = self.margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ConfigError(
                f"{self.NAME}: margin={margin!r} must be a number in [0, 1): the share by which a "
                "transform must beat the spatial basis' cost, e.g. margin=0.1"
            )
        object.__setattr__(self, "margin", float(margin))
        if self.scope not in SCOPES:
            raise ConfigError(f"{self.NAME}: scope={self.scope!r} is unknown; use {list(SCOPES)}")
        if self.header not in HEADERS:
            raise ConfigError(
                f"{self.NAME}: header={self.header!r} is unknown; use {list(HEADERS)}"
            )
        if self.scope == "chunk" and self.header != "fixed":
            raise ConfigError(
                f"{self.NAME}: scope=chunk keeps a fixed share per chunk, so it needs "
                "header=fixed (header=sparse varies the kept count per message)"
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
        if self.header == "sparse":
            return COUNT_BYTES + layout.nbytes
        return packed_bytes(chunks, _BASIS_BITS) + layout.nbytes

    def _switch_layout(self, numel: int) -> SwitchLayout:
        _, chunks, layout = self._sizes(numel)
        return SwitchLayout(
            chunks=chunks,
            bases=len(self._allowed()),
            universe=layout.universe,
            bits=self.bits,
            index=self.index,
            total_bytes=self.payload_bytes(numel),
        )

    def _allowed(self) -> tuple[int, ...]:
        """Codes (positions in :data:`BASES`) of the allowed bases, in code order."""
        names = self.bases.split("+")
        return tuple(code for code, name in enumerate(BASES) if name in names)

    def _lagrange_threshold(self, chunks: torch.Tensor, keep_share: float) -> torch.Tensor:
        """0-d ``lam``: the ``keep_share`` quantile of the input's energy, from a strided
        sample (on the input's device)."""
        spatial = chunks.reshape(-1)
        sample = spatial[:: max(1, spatial.numel() // _LAMBDA_SAMPLE)]
        rank = min(sample.numel(), max(1, round(sample.numel() * (1.0 - keep_share))))
        return kth_smallest(sample * sample, rank)[0]

    def _chunk_cost(
        self, coef: torch.Tensor, lam: torch.Tensor, *, scratch: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """``(C,)`` into ``out``: how badly one basis codes each chunk of ``coef`` ``(C, L)``
        (lower is better); ``scratch``: a ``(C, L)`` work buffer.

        ``choice="rd"``: the Lagrangian of "least dropped energy for k kept coefficients":
        with a threshold ``lam`` on squared magnitude (a kept coefficient costs ``lam``, a
        dropped one its energy) a chunk costs ``sum(min(c**2, lam))``. ``choice="l1"``: the L1
        norm (at equal energy, the smaller is the more compressible).
        """
        if self.choice == "rd":
            square = torch.mul(coef, coef, out=scratch)
            # NOTE: torch.minimum, not clamp(max=lam): clamp with a 0-d tensor bound takes a
            # slow broadcasting path on the CPU (~8x here).
            return torch.sum(torch.minimum(square, lam, out=square), dim=1, out=out)
        return torch.sum(torch.abs(coef, out=scratch), dim=1, out=out)

    def encode(self, grad: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        del generator  # deterministic
        flat = check_gradient(grad, codec_name=self.NAME).detach().to(torch.float32)
        numel = flat.numel()
        length, count, layout = self._sizes(numel)
        device = flat.device
        if count * length != numel:
            flat = torch.nn.functional.pad(flat, (0, count * length - numel))
        chunks = flat.view(count, length)  # (C, L); never written (it may be the caller's)
        lam = self._lagrange_threshold(chunks, layout.kept / layout.universe)
        allowed = self._allowed()
        transforms = {1: fourier, 2: dct}
        coefs = [
            chunks
            if code == 0
            else transforms[code](chunks, spectrum=spectrum_buffer(code, count, length, device))
            for code in allowed
        ]
        # NOTE: one kept (C, L) scratch for every cost and the score: each fresh 4 B/element buffer
        # costs page faults on the CPU (glibc hands large blocks back to the OS).
        scratch = workspace("adaptive.scratch", (count, length), torch.float32, device)
        cost = torch.empty(len(coefs), count, device=device)  # (B, C)
        for row, coef in enumerate(coefs):
            self._chunk_cost(coef, lam, scratch=scratch, out=cost[row])
        if allowed[0] == 0 and self.margin > 0:
            # A transform must beat the spatial basis by ``margin`` of its cost.
            cost[0] *= 1.0 - self.margin
        slot = cost.argmin(dim=0)  # (C,): ties go to the lowest code (spatial first)
        if self.header == "fixed":
            basis = torch.full_like(slot, allowed[0])  # (C,) codes; no host-to-device copy
            for index, code in enumerate(allowed[1:], start=1):
                basis.masked_fill_(slot == index, code)
            chosen = pick_rows(coefs, slot, sync_free=sync_free(flat))  # (C, L)
            del coefs
            values, mask, indices, floor = self._select(chosen, scratch, layout)
            message = pack_kept(values, mask, indices, floor, finite_flag(flat), layout)
            return Payload(torch.cat([pack_bits(basis, _BASIS_BITS), message]), numel)
        switches = self._switch_layout(numel)
        gain = cost[0] - cost.min(dim=0).values  # (C,): what switching a chunk saves
        ids = choose_switches(gain, lam, switches)  # (m,) sorted
        # The encoder knows each option's squared error (dropped energy plus quantisation): send
        # the switches only when they beat every chunk in the default basis (which alone meets
        # the Parseval bound before quantisation).
        best: tuple[float, torch.Tensor, torch.Tensor, _Kept, KeptLayout] | None = None
        for option in [ids, ids[:0]] if ids.numel() else [ids]:
            picked = torch.zeros_like(slot).index_copy_(0, option, slot.index_select(0, option))
            # With no switch the default basis' coefficients are sent as they are (never
            # written: the switched candidate's row picks go into the last basis' buffer).
            chosen = (
                pick_rows(coefs, picked, sync_free=sync_free(flat)) if option.numel() else coefs[0]
            )
            kept = switches.message(option.numel())
            selected = self._select(chosen, scratch, kept)
            error = relative_error(selected[0], selected[3], self.bits)
            if best is None or error < best[0]:
                best = (error, option, picked, selected, kept)
        assert best is not None
        _, ids, picked, selected, kept = best
        values, mask, indices, floor = selected
        message = pack_kept(values, mask, indices, floor, finite_flag(flat), kept)
        head = encode_switches(ids, picked.index_select(0, ids) - 1, switches)
        pad = switches.total_bytes - head.numel() - message.numel()
        return Payload(torch.cat([head, message, message.new_zeros(pad)]), numel)

    def _select(self, chosen: torch.Tensor, scratch: torch.Tensor, layout: KeptLayout) -> _Kept:
        """``(values (k, 1), mask, indices, floor)``: the kept coefficients of ``chosen``
        ``(C, L)`` as :func:`pack_kept` takes them (``scratch``: a ``(C, L)`` buffer)."""
        device = chosen.device
        count, length = chosen.shape
        score = torch.mul(chosen, chosen, out=scratch)  # (C, L)
        if self.scope == "chunk":
            per_chunk = kept_count(length, self.theta)
            top = torch.topk(score, per_chunk, dim=1, sorted=False).indices  # (C, k_c)
            offsets = torch.arange(count, device=device).unsqueeze(1) * length
            indices = torch.sort((top + offsets).reshape(-1)).values  # (k,)
            mask = torch.zeros(layout.universe, dtype=torch.bool, device=device)
            mask.index_fill_(0, indices, True)
        else:
            mask = None  # pack_kept builds it if the bitmap index needs it
            indices = select_indices(score.reshape(-1), layout.kept, self.select, period=length)
        values = gather_flat(chosen, indices).unsqueeze(1)  # (k, 1)
        return values, mask, indices, values.abs().min()

    def decode(self, payload: Payload) -> torch.Tensor:
        return self.decode_sum([payload])

    def decode_sum(self, payloads: Sequence[Payload]) -> torch.Tensor:
        """Sum every rank's coefficients per basis, then one inverse transform per basis."""
        numel = common_numel(payloads, codec_name=self.NAME)
        length, count, layout = self._sizes(numel)
        size = self.payload_bytes(numel)
        device = payloads[0].data.device
        rows = torch.arange(count, device=device)
        finite = torch.ones((), dtype=torch.bool, device=device)
        sums = None  # (3C, L) per-basis coefficient sums, only for several payloads
        for payload in payloads:
            data = payload.data
            if data.dtype != torch.uint8 or data.numel() != size:
                raise ConfigError(
                    f"{self.NAME}: payload has {data.numel()} {data.dtype} elements, expected "
                    f"{size} uint8 for numel={numel}; was it made by {self.spec}?"
                )
            basis, message, kept = self._read_basis(data, numel)
            coef = torch.zeros(layout.universe, 1, device=device)
            finite = finite & add_kept(coef, message, kept)
            if len(payloads) == 1:
                return nan_unless(
                    finite,
                    inverse_rows(coef.view(count, length), basis, sync_free=sync_free(coef))[
                        :numel
                    ],
                )
            if sums is None:
                sums = torch.zeros(len(BASES) * count, length, device=device)
            sums.index_add_(0, basis * count + rows, coef.view(count, length))
        assert sums is not None
        per_basis = sums.view(len(BASES), count, length)
        signal = per_basis[0].clone()
        for code, inverse in ((1, inverse_fourier), (2, inverse_dct)):
            signal += inverse(per_basis[code])
        return nan_unless(finite, signal.reshape(-1)[:numel])

    def _read_basis(
        self, data: torch.Tensor, numel: int
    ) -> tuple[torch.Tensor, torch.Tensor, KeptLayout]:
        """``(basis codes (C,), kept-message bytes, their layout)`` of one payload."""
        _, count, layout = self._sizes(numel)
        if self.header == "fixed":
            head = packed_bytes(count, _BASIS_BITS)
            basis = unpack_bits(data[:head], _BASIS_BITS, count).clamp_(max=len(BASES) - 1)
            return basis, data[head:], layout
        return read_basis(data, self._switch_layout(numel), self._allowed())
