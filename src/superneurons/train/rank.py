"""One rank joins the process group torchrun prepared, on the device the policy gives it, and
leaves it at the end without aborting.

The backend and the device come from :mod:`superneurons.device` (one GPU per NCCL rank; CPU and
gloo when a node has fewer GPUs than ranks and the backend is ``auto``); the launcher made the
same choice before starting the ranks, from the same function.

Every process that ends a process group ends through :func:`exit_rank` (the trainer's ranks, the
bench workers, the examples, the tests' spawned ranks). Why: ``destroy_process_group`` does not
join gloo's worker threads (only the backend's destructor does, and DDP's reducer, a comm hook's
state or any other holder keeps the backend alive into interpreter shutdown). A worker thread
that finished a collective may still be releasing Python objects: a ``Future.then`` callback
and its closure, gradient tensors. If the main thread reaches interpreter finalisation first,
that thread's attempt to take the GIL ends it with a forced unwind through a ``noexcept``
destructor: ``terminate called without an active exception``, SIGABRT, after all work is done
(pytorch#179291 and its discussion: an ``atexit`` destroy does not close the race). A holder
released after the group was destroyed can hang instead: DDP's reducer is bound without
releasing the GIL in its destructor, so when it holds the backend's last reference (accelerate's
``end_training()`` destroyed the group, then the function holding the model returned) it joins
gloo's threads with the GIL held, while one of them waits for the GIL to release a tensor of a
finished collective (seen once in a suite run of the accelerate example, as a 240 s timeout). So
a rank meets its peers at a barrier (every collective complete, no rank leaves while a peer still
sends to it), destroys the group, flushes logging and stdio, and leaves with ``os._exit``, so
that no finaliser runs beside gloo's threads; it calls :func:`exit_rank` while the model is
alive (the last line of the function that holds it), so no destructor joins them either.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist

from superneurons.device import Placement, choose_backend, rank_device

__all__ = ["COLLECTIVE_TIMEOUT_S", "exit_rank", "init_distributed", "leave_process_group"]

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
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        dist.init_process_group(choice.backend, timeout=timeout)
        return placement
    # NOTE: torchrun's agent keeps one TCP store for every restart of the workers, and the
    # process group's keys (gloo's peer addresses) are not per attempt: restarted workers
    # read the dead workers' addresses and fail with "Connection refused" (pytorch#167288).
    # Each attempt gets its own key space.
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    dist.init_process_group(
        choice.backend,
        store=dist.PrefixStore(f"superneurons/attempt{restart}", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    return placement


def leave_process_group(*, barrier: bool = True) -> None:
    """Destroy the default process group; first, with ``barrier``, wait until every rank got
    here (on gloo the barrier also waits for every earlier collective of this rank). Nothing
    to do when no group is initialised. A barrier that fails (a peer is gone) is logged, and
    the group is destroyed all the same; pass ``barrier=False`` on a failure path, where a
    peer may never arrive."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if barrier:
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[torch.cuda.current_device()])
            else:
                dist.barrier()
    except Exception as exc:  # noqa: BLE001 - leaving must not fail; the peer's status tells
        logger.warning("leaving the process group without the final barrier: %s", exc)
    finally:
        dist.destroy_process_group()


def exit_rank(status: int = 0) -> NoReturn:
    """End this process with ``status``: leave the process group (with the final barrier when
    ``status`` is 0), flush logging, stdout and stderr, then ``os._exit(status)``.

    The one way a process that used a process group ends (see the module docstring for why the
    interpreter's own exit can abort, and a released DDP model hang); call it last, after every
    file is written and closed, while the model is alive: ``atexit`` handlers and finalisers do
    not run.
    """
    try:
        leave_process_group(barrier=status == 0)
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # closed, or a broken pipe
                stream.flush()
        os._exit(status)
