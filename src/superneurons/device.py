"""Where a rank computes, and putting things there: the one place that decides devices.

* :func:`choose_backend` turns ``--backend auto|gloo|nccl`` and the number of ranks on this node
  into the process-group backend, before any rank starts (the launcher) and again inside each
  rank (torchrun started by the user), with the same answer.
* :func:`rank_device` maps a rank's ``LOCAL_RANK`` to its device, never to a GPU that is not
  there.
* :class:`Placement` moves a model, a batch (tensors at any nesting of tuples, lists, dicts)
  and targets to that device — the trainer, the demo and the examples all go through it.

Policy (also in ``superneurons train --help`` and the README): NCCL runs one rank per GPU. With
``--backend auto`` and fewer GPUs than ranks on a node, all ranks run on CPU with gloo and the
launcher says so in one line; ``--backend nccl`` with fewer GPUs than ranks stops before
launching and says what to pass. ``--backend gloo`` means CPU ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from superneurons.errors import ConfigError

__all__ = ["BACKENDS", "BackendChoice", "Placement", "choose_backend", "cuda_count", "rank_device"]

logger = logging.getLogger("superneurons.device")

BACKENDS = ("auto", "gloo", "nccl")

T = TypeVar("T")


def cuda_count() -> int:
    """CUDA devices this process can use (0 on a CPU build or without a driver)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class BackendChoice:
    """The process-group backend for a node's ranks, and the one-line note when it is not what
    ``--backend auto`` would pick on a machine with enough GPUs."""

    backend: str  # "nccl" or "gloo"
    note: str | None = None


def choose_backend(backend: str, *, local_world_size: int) -> BackendChoice:
    """The backend ``local_world_size`` ranks on this node use for ``--backend backend``.

    Raises:
        ConfigError: an unknown backend, or ``nccl`` without one GPU per rank (the message
            says what to pass instead).
    """
    if backend not in BACKENDS:
        raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "gloo":
        return BackendChoice("gloo")
    gpus = cuda_count()
    if backend == "nccl":
        if gpus == 0:
            raise ConfigError(
                "--backend nccl needs CUDA devices and none is visible; pass --backend gloo (CPU)"
            )
        if gpus < local_world_size:
            raise ConfigError(
                f"--backend nccl runs one rank per GPU: {local_world_size} ranks on this node but "
                f"{gpus} GPU(s) visible; pass --nproc {gpus} or --backend gloo (CPU)"
            )
        return BackendChoice("nccl")
    if gpus == 0:
        return BackendChoice("gloo")
    if gpus < local_world_size:
        return BackendChoice(
            "gloo",
            f"{local_world_size} ranks but {gpus} GPU(s): running every rank on CPU with gloo "
            f"(pass --nproc {gpus} to train on the GPU)",
        )
    return BackendChoice("nccl")


def rank_device(backend: str, local_rank: int) -> torch.device:
    """The device of the rank with ``local_rank`` on its node: ``cuda:local_rank`` under NCCL
    (one GPU per rank), the CPU under gloo."""
    if backend != "nccl":
        return torch.device("cpu")
    gpus = cuda_count()
    if not 0 <= local_rank < gpus:
        raise ConfigError(
            f"local rank {local_rank} has no GPU ({gpus} visible): start at most {gpus} ranks "
            "per node with NCCL, or use --backend gloo"
        )
    return torch.device("cuda", local_rank)


@dataclass(frozen=True)
class Placement:
    """Puts models, batches and targets on ``device``.

    Batches are moved with ``non_blocking`` on CUDA: from pinned memory (``pin_memory`` is what
    a ``DataLoader`` should be given) the copy overlaps host work and stays ordered before the
    kernels that read it on the same stream; from pageable memory it is an ordinary copy.
    """

    device: torch.device = torch.device("cpu")

    @classmethod
    def of(cls, where: Placement | torch.device | str) -> Placement:
        """``where`` itself if it is a placement, else a placement on that device."""
        return where if isinstance(where, Placement) else cls(torch.device(where))

    @property
    def pin_memory(self) -> bool:
        """Whether a DataLoader feeding this device should pin its batches."""
        return self.device.type == "cuda"

    def module(self, model: nn.Module) -> nn.Module:
        """``model`` with its parameters and buffers on the device (in place, returned)."""
        return model.to(self.device)

    def batch(self, data: T) -> T:
        """``data`` with every tensor on the device: tensors, and tuples (named ones too),
        lists and mappings of them at any depth; anything else is returned as it is."""
        return self._move(data)  # type: ignore[no-any-return]

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=self.pin_memory)

    def _move(self, data: Any) -> Any:
        if isinstance(data, torch.Tensor):
            return self.tensor(data)
        if isinstance(data, tuple) and hasattr(data, "_fields"):  # a namedtuple
            return type(data)(*(self._move(item) for item in data))
        if isinstance(data, (tuple, list)):
            return type(data)(self._move(item) for item in data)
        if isinstance(data, Mapping):
            return type(data)({key: self._move(value) for key, value in data.items()})  # type: ignore[call-arg]
        return data
