"""One memory plan for every rank of a process group.

Ranks that profile their own step can plan differently (measured timings tip ``auto``, a
kernel's scratch differs), and ranks that step differently cannot share DDP's buckets; a rank
whose planner raises while the others go on leaves them waiting in the next collective. So
rank 0 plans and every rank applies its plan, or raises its error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from superneurons.errors import ConfigError
from superneurons.memory.plan import InfeasibleBudgetError, Plan

__all__ = ["planned_on_rank_zero"]


def planned_on_rank_zero(make: Callable[[], Plan]) -> Plan:
    """``make()`` on rank 0, its plan (or its error) on every rank; local without a group.

    Rank 0 raises what ``make`` raised; the other ranks raise an :class:`InfeasibleBudgetError`
    with the same minimum and strategy where rank 0's budget did not fit, else a
    :class:`ConfigError` carrying rank 0's message.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return make()
    box: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            box = [("plan", make().to_json())]
        except Exception as exc:  # noqa: BLE001 - tell the other ranks instead of leaving them
            error, box = exc, [_failure(exc)]
    # NOTE: broadcast_object_list sends a pickled byte tensor, on the device the backend wants.
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    kind, *details = box[0]
    if kind == "infeasible":
        message, min_budget_bytes, strategy = details
        raise InfeasibleBudgetError(
            f"rank 0 could not plan: {message}",
            min_budget_bytes=min_budget_bytes,
            strategy=strategy,
        )
    if kind == "error":
        raise ConfigError(f"rank 0 could not plan: {details[0]}")
    return Plan.from_json(details[0])


def _failure(exc: BaseException) -> tuple[Any, ...]:
    """What the other ranks learn of rank 0's planning error (picklable)."""
    if isinstance(exc, InfeasibleBudgetError):
        return ("infeasible", str(exc), exc.min_budget_bytes, exc.strategy)
    return ("error", str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}")
