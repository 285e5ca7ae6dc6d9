"""Gradient buckets of the host optimizer, and what they hold on the device (pure).

With ``Plan.host_optimizer`` gradients leave the device bucket by bucket: a bucket is launched
(all-reduced under data parallelism, PyTorch DDP's unit of communication) as soon as its last
gradient is born and every earlier bucket has been launched, so all ranks launch in one order;
launching bucket ``b + 1`` drains bucket ``b`` (its reduced gradients go to the host, where the
optimizer steps its parameters: :mod:`superneurons.memory.offload.host_optimizer`). The planner
assigns the buckets from the profile (:func:`assign_buckets`), so the runtime launches exactly the
buckets whose device bytes :func:`bucket_timeline` predicts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "BUCKET_CAPS",
    "DEFAULT_BUCKET_CAP_BYTES",
    "MIN_BUCKET_CAP_BYTES",
    "assign_buckets",
    "bucket_cap_bytes",
    "bucket_timeline",
]

# NOTE: DistributedDataParallel's default ``bucket_cap_mb=25``: large enough that the per-call
# latency of a collective is amortised, small enough that the first one starts early.
DEFAULT_BUCKET_CAP_BYTES = 25 * 2**20
# NOTE: a collective of 64 KiB costs ~its latency alone (tens of us on NVLink/IB); smaller
# buckets only add calls.
MIN_BUCKET_CAP_BYTES = 64 * 2**10
# the caps the planner tries, smallest first: it searches with the smallest (gradients leave
# the device soonest) and then takes the widest one the budget allows
BUCKET_CAPS: tuple[int, ...] = tuple(MIN_BUCKET_CAP_BYTES * 4**k for k in range(5)) + (
    DEFAULT_BUCKET_CAP_BYTES,
)


Gradient = tuple[int, int, int]  # (birth event, ready event: its hook, bytes): Profile.gradients


def bucket_cap_bytes(gradients: Sequence[Gradient]) -> int:
    """The bucket cap the planner uses: the largest gradient (a bucket then holds no more than
    one large gradient's bytes), within ``[MIN_BUCKET_CAP_BYTES, DEFAULT_BUCKET_CAP_BYTES]``."""
    largest = max((nbytes for _, _, nbytes in gradients), default=0)
    return min(max(largest, MIN_BUCKET_CAP_BYTES), DEFAULT_BUCKET_CAP_BYTES)


def assign_buckets(
    gradients: Sequence[Gradient],
    grad_params: Sequence[str],
    *,
    cap_bytes: int | None = None,
) -> tuple[tuple[str, ...], ...]:
    """Parameter fqns in the order their gradients are ready (accumulated), packed greedily into
    buckets of at most ``cap_bytes`` (default :func:`bucket_cap_bytes`; a larger gradient is a
    bucket of its own). Gradients without a recorded parameter are left out (the runtime steps
    them when backward ends)."""
    cap_bytes = bucket_cap_bytes(gradients) if cap_bytes is None else cap_bytes
    order = sorted(range(len(gradients)), key=lambda i: (gradients[i][1], i))
    buckets: list[tuple[str, ...]] = []
    current: list[str] = []
    size = 0
    for i in order:
        name, nbytes = grad_params[i] if i < len(grad_params) else "", gradients[i][2]
        if not name:
            continue
        if current and size + nbytes > cap_bytes:
            buckets.append(tuple(current))
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        buckets.append(tuple(current))
    return tuple(buckets)


def bucket_timeline(
    gradients: Sequence[Gradient],
    grad_params: Sequence[str],
    buckets: Sequence[Sequence[str]],
    *,
    num_events: int,
    backward_end: int,
    staged: bool = False,
) -> np.ndarray:
    """Device bytes of gradients per event under the host optimizer.

    A bucket is ready when its last gradient is accumulated; a gradient lives from its birth
    until its bucket is launched (the launch copies a bucket of
    several gradients into one flat buffer, which is live at that event beside them; a bucket of
    one gradient is sent as it is); the flat buffer (or the lone gradient) lives until the next
    bucket's launch drains it, the last one until backward ends. Gradients in no bucket live
    until backward ends. ``staged`` (gradient accumulation, the last micro-batch): at its launch
    each bucket's sum of the earlier micro-batches is copied back from the host beside it and
    added into it (one more bucket of bytes at that event).
    """
    last = num_events - 1
    where = {name: i for i, name in enumerate(grad_params) if name}
    change = np.zeros(num_events + 1, dtype=np.int64)

    def live(start: int, end: int, nbytes: int) -> None:
        start, end = min(max(start, 0), last), min(max(end, start), last)
        change[start] += nbytes
        change[end + 1] -= nbytes

    launches: list[int] = []
    members: list[list[int]] = []
    previous = -1
    for bucket in buckets:
        indices = [where[name] for name in bucket if name in where]
        if not indices:
            continue
        ready = max(gradients[i][1] for i in indices)
        previous = max(ready, previous)
        launches.append(previous)
        members.append(indices)
    bucketed = {i for group in members for i in group}
    end_of_backward = min(max(backward_end, 0), last)
    for b, (launch, indices) in enumerate(zip(launches, members, strict=True)):
        drained = launches[b + 1] if b + 1 < len(launches) else end_of_backward
        drained = max(drained, launch)
        if len(indices) == 1:
            i = indices[0]
            live(gradients[i][0], drained, gradients[i][2])
            continue
        for i in indices:
            live(gradients[i][0], launch, gradients[i][2])
        live(launch, drained, sum(gradients[i][2] for i in indices))
    if staged:
        for launch, indices in zip(launches, members, strict=True):
            live(launch, launch, sum(gradients[i][2] for i in indices))
    for i, (birth, _ready, nbytes) in enumerate(gradients):
        if i not in bucketed:
            live(birth, end_of_backward, nbytes)
    return np.cumsum(change[:-1])
