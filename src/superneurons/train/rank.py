"""One rank joins the process group torchrun prepared, on the device the policy gives it.

The backend and the device come from :mod:`superneurons.device` (one GPU per NCCL rank; CPU and
gloo when a node has fewer GPUs than ranks and the backend is ``auto``); the launcher made the
same choice before starting the ranks, from the same function.
"""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

from superneurons.device import Placement, choose_backend, rank_device

__all__ = ["COLLECTIVE_TIMEOUT_S", "init_distributed"]

logger = logging.getLogger("superneurons.train")

# NOTE: a rank that waits longer than this on a collective fails instead of hanging forever.
COLLECTIVE_TIMEOUT_S = 300


def init_distributed(backend: str) -> Placement:
    """Join the process group (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set by torchrun);
    returns where this rank computes.

    ``backend="auto"``: NCCL when this node has a GPU per rank (``LOCAL_WORLD_SIZE``), else gloo
    on CPU. Raises :class:`~superneurons.errors.ConfigError` for ``nccl`` without a GPU per rank.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    choice = choose_backend(backend, local_world_size=local_world_size)
    if choice.note is not None and local_rank == 0:
        logger.info("%s", choice.note)  # the launcher has shown it already
    placement = Placement(rank_device(choice.backend, local_rank))
    if placement.device.type == "cuda":
        torch.cuda.set_device(placement.device)
    dist.init_process_group(
        choice.backend, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    return placement
