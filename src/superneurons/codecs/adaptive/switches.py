"""The adaptive codec's switch header: pay only for the chunks that leave the default basis.

A fixed 2-bit basis code per chunk (``header="fixed"``) costs ``C / 4`` bytes whether or not
any chunk switches; on gradients whose chunks nearly all stay spatial (HF ResNet-18 in
benchmarks/results/codecs/README.md) that is pure cost against Top-k. ``header="sparse"`` keeps
the payload size fixed (gathered payloads must be; ``payload_bytes`` stays a function of
``numel``) but lets the kept count vary per message with the number ``m`` of switched chunks::

    [m: int32, 4 B][switched chunk ids: bitmap over C or Elias-Fano, the smaller]
    [their bases: ceil(log2(B - 1)) bits each][kept message at k(m)][zero padding]

``k(m)`` is the largest kept count whose message fits the bytes left (a pure function of
``numel``, the codec's options and ``m``), so a message with no switch keeps as many
coefficients as compactly coded Top-k does in the same bytes less 4, and each switch pays for
its own position (indices coded as in :mod:`superneurons.codecs.coding.indexcode`; Elias-Fano:
Vigna, WSDM 2013). Which chunks switch is a Lagrangian choice (Shoham & Gersho, "Efficient bit
allocation for an arbitrary set of quantizers", IEEE TASSP 1988): switch the ``m`` chunks with
the largest cost gains when their summed gain exceeds ``lam`` times the coefficients their
header bytes displace, ``lam`` being the threshold energy of a kept coefficient.
"""

from __future__ import annotations

import functools
import math

import torch

from superneurons.codecs.coding.bitpack import pack_bits, packed_bytes, unpack_bits
from superneurons.codecs.coding.indexcode import (
    INDEX_KINDS,
    decode_bitmap,
    decode_gap,
    encode_bitmap,
    encode_gap,
    index_bytes,
)
from superneurons.codecs.coding.rangefloat import dequantize, quantize
from superneurons.codecs.coding.sparsecode import KeptLayout
from superneurons.errors import ConfigError

__all__ = [
    "COUNT_BYTES",
    "SwitchLayout",
    "choose_switches",
    "decode_switches",
    "encode_switches",
    "read_basis",
    "read_count",
    "relative_error",
    "switch_code_bits",
]

COUNT_BYTES = 4  # int32 m, little-endian
_SWITCH_PRICE = 1.0  # a kept coefficient's worth in units of lam when pricing switches


def switch_code_bits(bases: int) -> int:
    """Bits naming a switched chunk's basis among the ``bases - 1`` non-default ones."""
    return math.ceil(math.log2(bases - 1)) if bases > 2 else 0


def _id_kind(chunks: int, switched: int) -> str:
    sizes = {kind: index_bytes(kind, chunks, switched) for kind in INDEX_KINDS}
    return min(INDEX_KINDS, key=lambda kind: (sizes[kind], kind != "bitmap"))


@functools.lru_cache(maxsize=256)
def _kept_table(
    chunks: int, code_bits: int, budget: int, universe: int, bits: int, index: str
) -> tuple[int, ...]:
    """``k(m)`` for ``m = 0..chunks``: the largest kept count whose message fits the
    ``budget`` bytes left after the count and the switch header (0: none fits)."""
    # The room shrinks as m grows (both id codes grow with m), so k(m) is found by stepping
    # down from k(m - 1) instead of a bisection per m.
    kept = _largest_kept(budget, universe, bits, index)
    table = []
    for switched in range(chunks + 1):
        room = budget - _switch_bytes(chunks, switched, code_bits)
        while kept > 0 and _message_bytes(kept, universe, bits, index) > room:
            kept -= 1
        table.append(kept)
    return tuple(table)


def _switch_bytes(chunks: int, switched: int, code_bits: int) -> int:
    if switched == 0:
        return 0
    ids = index_bytes(_id_kind(chunks, switched), chunks, switched)
    return ids + (packed_bytes(switched, code_bits) if code_bits else 0)


def _largest_kept(room: int, universe: int, bits: int, index: str) -> int:
    """Largest ``k`` in ``1..universe`` with ``KeptLayout(universe, k).nbytes <= room`` (the
    size grows with ``k``), or 0."""
    if _message_bytes(1, universe, bits, index) > room:
        return 0
    low, high = 1, universe
    while low < high:
        mid = (low + high + 1) // 2
        fits = _message_bytes(mid, universe, bits, index) <= room
        low, high = (mid, high) if fits else (low, mid - 1)
    return low


def _message_bytes(kept: int, universe: int, bits: int, index: str) -> int:
    return KeptLayout(universe, kept, 1, bits, index).nbytes


class SwitchLayout:
    """Sizes of a ``header="sparse"`` payload of ``total_bytes`` over ``chunks`` chunks of a
    ``universe`` of coefficients, ``bases`` allowed bases; ``kept(m)`` as in the module doc."""

    def __init__(
        self, *, chunks: int, bases: int, universe: int, bits: int, index: str, total_bytes: int
    ) -> None:
        self.chunks = chunks
        self.bases = bases
        self.code_bits = switch_code_bits(bases)
        self.universe = universe
        self.bits = bits
        self.index = index
        self.total_bytes = total_bytes
        self.kept_by_switched = _kept_table(
            chunks, self.code_bits, total_bytes - COUNT_BYTES, universe, bits, index
        )

    def switch_bytes(self, switched: int) -> int:
        return _switch_bytes(self.chunks, switched, self.code_bits)

    def kept(self, switched: int) -> int:
        return self.kept_by_switched[switched]

    def message(self, switched: int) -> KeptLayout:
        kept = self.kept(switched)
        if kept < 1:
            raise ConfigError(f"adaptive: {switched} switched chunks leave no room to keep one")
        return KeptLayout(self.universe, kept, 1, self.bits, self.index)


def encode_switches(ids: torch.Tensor, codes: torch.Tensor, layout: SwitchLayout) -> torch.Tensor:
    """``[m][ids][codes]`` bytes for the sorted switched chunk ``ids`` (int64) and their
    basis ``codes`` (0-based among the non-default bases), on ``ids``' device."""
    switched = ids.numel()
    count = torch.tensor([switched], dtype=torch.int32, device=ids.device).view(torch.uint8)
    if switched == 0:
        return count
    parts = [count]
    if _id_kind(layout.chunks, switched) == "bitmap":
        mask = torch.zeros(layout.chunks, dtype=torch.bool, device=ids.device)
        parts.append(encode_bitmap(mask.index_fill_(0, ids, True)))
    else:
        parts.append(encode_gap(ids, layout.chunks))
    if layout.code_bits:
        parts.append(pack_bits(codes, layout.code_bits))
    return torch.cat(parts)


def read_count(data: torch.Tensor, chunks: int) -> int:
    """The switched-chunk count ``m`` of a payload (read on the host: sizes follow from it)."""
    switched = int(data[:COUNT_BYTES].clone().view(torch.int32)[0])
    if not 0 <= switched <= chunks:
        raise ConfigError(f"adaptive: payload says {switched} switched chunks of {chunks}")
    return switched


def decode_switches(
    data: torch.Tensor, switched: int, layout: SwitchLayout, *, sync_free: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, codes)`` of ``switched`` chunks from the bytes after the count."""
    device = data.device
    if switched == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return empty, empty
    id_bytes = index_bytes(_id_kind(layout.chunks, switched), layout.chunks, switched)
    if _id_kind(layout.chunks, switched) == "bitmap":
        ids = decode_bitmap(data[:id_bytes], layout.chunks).nonzero().reshape(-1)
    else:
        ids = decode_gap(data[:id_bytes], layout.chunks, switched, sync_free=sync_free)
    if not layout.code_bits:
        return ids, torch.zeros_like(ids)
    return ids, unpack_bits(data[id_bytes:], layout.code_bits, switched)


def read_basis(
    data: torch.Tensor, layout: SwitchLayout, allowed: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, KeptLayout]:
    """``(basis codes (C,), kept-message bytes, their layout)`` of one payload; ``allowed``:
    the codes of the allowed bases, the first being the default."""
    switched = read_count(data, layout.chunks)
    if layout.kept(switched) < 1 or (switched and len(allowed) < 2):
        raise ConfigError(f"adaptive: payload says {switched} switched chunks, too many")
    sync_free = data.device.type != "cpu"
    ids, codes = decode_switches(data[COUNT_BYTES:], switched, layout, sync_free=sync_free)
    basis = torch.full((layout.chunks,), allowed[0], dtype=torch.int64, device=data.device)
    if switched:
        others = torch.tensor(allowed[1:], dtype=torch.int64, device=data.device)
        basis.index_copy_(0, ids, others.index_select(0, codes.clamp(max=len(allowed) - 2)))
    start = COUNT_BYTES + layout.switch_bytes(switched)
    kept = layout.message(switched)
    return basis, data[start : start + kept.nbytes], kept


def choose_switches(gain: torch.Tensor, lam: torch.Tensor, layout: SwitchLayout) -> torch.Tensor:
    """Sorted ids of the chunks to switch to their best basis: the ``m`` largest ``gain``
    ``(C,)`` for the ``m`` that minimises ``lam * (k(0) - k(m)) - their summed gain`` (the
    Lagrangian cost of the message: each coefficient the header displaces is worth ``lam``).
    Reads ``m`` on the host (the payload's sizes follow from it)."""
    if layout.kept(1) < 1 or layout.bases < 2:
        return torch.zeros(0, dtype=torch.int64, device=gain.device)
    # Non-finite input (its payload decodes to NaN anyway) switches nothing.
    gain = torch.nan_to_num(gain, nan=0.0, posinf=0.0, neginf=0.0)
    order = torch.argsort(gain, descending=True)  # (C,)
    total = torch.cat([gain.new_zeros(1), torch.cumsum(gain.index_select(0, order), 0)])
    kept = torch.tensor(layout.kept_by_switched, dtype=torch.float32, device=gain.device)
    objective = (kept[0] - kept) * (lam * _SWITCH_PRICE) - total  # (C + 1,)
    objective.masked_fill_(kept < 1, torch.inf)
    switched = int(objective.argmin())
    return torch.sort(order[:switched]).values


def relative_error(values: torch.Tensor, floor: torch.Tensor, bits: int) -> float:
    """A message's squared error less its input's energy (host float): the kept ``values``'
    range-float quantisation error (window ``[floor, max]``) minus their energy."""
    sent = values.reshape(-1)
    if bits == 32:
        return -float(sent.square().sum())
    codes, header = quantize(sent, bits, threshold=floor)
    error = torch.sub(sent, dequantize(codes, header, bits)).square_().sum()
    return float(error - sent.square().sum())
