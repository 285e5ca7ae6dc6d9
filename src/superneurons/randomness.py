"""Python's global random stream, kept as it was around work that may draw from it.

torch's streams are kept with :func:`torch.random.fork_rng`; Python's ``random`` module has no
such fork. A library call that runs other libraries' code (torchrun's agent draws rendezvous
delays from it) must leave the caller's stream where it was, or a seeded run stops repeating.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

__all__ = ["python_random_kept"]


@contextlib.contextmanager
def python_random_kept() -> Iterator[None]:
    """Python's global random state as it was before the block, also when the block raises."""
    state = random.getstate()
    try:
        yield
    finally:
        random.setstate(state)
