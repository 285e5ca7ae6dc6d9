"""PyTorch's own DDP reductions as configs: ``dense``, ``torch-fp16``, ``torch-powersgd``.

Benchmarks compare our codecs against what a PyTorch user already has; these frozen configs name
them in the one spec table (:mod:`superneurons.schemes.grammar`) and
:func:`superneurons.ddp.torch_hooks.register_anchor` installs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from superneurons.codecs.canonical import Canonical
from superneurons.errors import ConfigError

__all__ = ["TorchAnchor", "TorchDense", "TorchFp16", "TorchPowerSGD"]


@dataclass(frozen=True)
class _Anchor(Canonical):
    """What every anchor shares: a spec name, summable (DDP all-reduces it), str() = spec."""

    NAME: ClassVar[str]

    @property
    def summable(self) -> bool:
        return True


@dataclass(frozen=True)
class TorchDense(_Anchor):
    """DDP's own fp32 all-reduce, no hook at all: the honest anchor (``dense``)."""

    NAME: ClassVar[str] = "dense"


@dataclass(frozen=True)
class TorchFp16(_Anchor):
    """``default_hooks.fp16_compress_hook`` (``torch-fp16``)."""

    NAME: ClassVar[str] = "torch-fp16"


@dataclass(frozen=True)
class TorchPowerSGD(_Anchor):
    """``powerSGD_hook.powerSGD_hook`` at approximation ``rank`` (``torch-powersgd:rank=4``)."""

    rank: int = 4
    NAME: ClassVar[str] = "torch-powersgd"

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"torch-powersgd: rank must be an integer >= 1, got {self.rank!r}")


TorchAnchor = TorchDense | TorchFp16 | TorchPowerSGD
