"""Future callbacks that compute with the hook's own intra-op thread count.

A ``Future.then`` callback of an asynchronous collective runs on the backend's thread (gloo's
worker, not the rank's main thread). ``torch.set_num_threads`` does not reach that thread's
BLAS: a product there ran with a different thread count, which sums in a different order, so
PowerSGD's decompression (``P̂ Q̂ᵀ`` into the bucket) differed in the last bit between otherwise
identical runs, depending on whether the all-reduce had finished before ``then`` was called
(callback inline) or not (callback on the worker). Bitwise resume needs the same arithmetic
every time, so every callback that computes first adopts the caller's thread count.

A callback that does not read its future's value never sees the collective fail: the chained
future would complete, and DDP would apply whatever the buffer held (on the peer of a killed
rank: a step that never completed everywhere). So the callback first reads the value, and the
value of every future a ``collect_all`` gathered: a failed collective raises through the chain,
and DDP's backward raises with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["raise_if_failed", "then_same_threads"]

T = TypeVar("T")
R = TypeVar("R")


def then_same_threads(
    fut: torch.futures.Future[T], fn: Callable[[torch.futures.Future[T]], R]
) -> torch.futures.Future[R]:
    """``fut.then(fn)``, with ``fn`` run under the intra-op thread count of the caller, and only
    once ``fut`` (and every future it collected) completed without an error."""
    threads = torch.get_num_threads()

    def run(done: torch.futures.Future[T]) -> R:
        raise_if_failed(done)
        torch.set_num_threads(threads)  # NOTE: idempotent: the value this rank already chose
        return fn(done)

    return fut.then(run)


def raise_if_failed(done: torch.futures.Future[Any]) -> None:
    """Raise the error of ``done``, or of any future in its value (``collect_all``)."""
    value = done.value()  # raises what the collective raised
    if isinstance(value, list):
        for part in value:
            if isinstance(part, torch.futures.Future):
                part.value()
