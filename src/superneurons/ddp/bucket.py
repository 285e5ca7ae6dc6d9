"""A DDP bucket seen per parameter: named flat views, and the route each one takes.

DDP hands the comm hook one flat buffer per bucket; everything the hook keeps is keyed by
parameter name (DDP rebuilds its buckets after the first step and after a resume), so the
bucket is split into :class:`Piece` views first. A :data:`Route` says how one parameter is
averaged: ``None`` is the plain fp32 all-reduce, otherwise a codec, :class:`PowerSGD` or
:class:`TwoPhase`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from superneurons.codecs.codec import Codec
from superneurons.codecs.powersgd import PowerSGD
from superneurons.codecs.twophase import TwoPhase
from superneurons.errors import ConfigError

__all__ = ["Piece", "Route", "pieces_of"]

Route = Codec | PowerSGD | TwoPhase | None  # None: plain fp32 all-reduce


@dataclass(frozen=True)
class Piece:
    """One parameter's slice of a flat bucket."""

    name: str
    flat: torch.Tensor  # (numel,) view of the bucket buffer
    shape: torch.Size
    start: int  # element offset in the bucket


def pieces_of(names_by_param: dict[int, str], bucket: dist.GradBucket) -> list[Piece]:
    """Split the flat bucket into per-parameter views, named by ``names_by_param``."""
    buffer = bucket.buffer()
    pieces: list[Piece] = []
    offset = 0
    for param in bucket.parameters():
        name = names_by_param.get(id(param))
        if name is None:
            raise ConfigError("a DDP bucket holds a parameter the module does not name")
        n = param.numel()
        pieces.append(Piece(name, buffer[offset : offset + n], param.shape, offset))
        offset += n
    if offset != buffer.numel():
        raise ConfigError(f"bucket of {buffer.numel()} elements, parameters hold {offset}")
    return pieces
