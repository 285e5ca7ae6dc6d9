"""The two-phase exchange as a DDP hook's route: a bucket's two-phase parameters in one
exchange (:mod:`.twophase`), its second phase deferred to the next bucket's hook.

:func:`twophase_reduce` starts the exchange of a bucket's parameters (their worker stage and
the all-to-all). For every bucket but the last of a backward pass it returns at once, and
:func:`flush_twophase`, which the hook calls before anything else, completes it from the next
bucket's hook (the owners' stage and the all-gather): the all-to-all travels while autograd
computes that bucket, and the order of collectives is the same on every rank (this bucket's
all-to-all, its all-gather, then the next bucket's collectives). :func:`release_twophase`
hands what two-phase residuals still owe to a route that sums (``auto`` moved a parameter).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from superneurons.codecs.twophase import TwoPhase
from superneurons.ddp.twophase import Exchange, complete, start
from superneurons.ddp.twophase_state import TwoPhaseState

if TYPE_CHECKING:
    from superneurons.ddp.bucket import Piece, Route
    from superneurons.ddp.state import CompressionState

__all__ = ["flush_twophase", "release_twophase", "twophase_reduce"]

Future = torch.futures.Future[Any]


def release_twophase(state: CompressionState, pieces: list[Piece], indices: Sequence[int]) -> None:
    """What two-phase residuals still owe, moved to ``state.residuals`` for the route that
    now carries those parameters (``auto`` moved them)."""
    assert state.twophase is not None
    for i in indices:
        piece = pieces[i]
        owed = state.twophase.release(piece.name, piece.flat.numel(), state.rank)
        if owed is not None:
            held = state.residuals.get(piece.name)
            state.residuals[piece.name] = owed if held is None else held + owed


def twophase_reduce(
    state: CompressionState,
    pieces: list[Piece],
    routes: list[Route],
    indices: list[int],
    finishers: list[Callable[[], None]],
    *,
    defer: bool = False,
) -> Future:
    """A DDP bucket's two-phase parameters (``indices``) in one exchange (the route of
    :func:`~superneurons.ddp.reduce.reduce_bucket`); the decode joins ``finishers``.

    ``defer``: return once the all-to-all is issued; its second phase (owners' stage, all-
    gather) runs at the start of the next bucket's hook (:func:`flush_twophase`), so the all-
    to-all travels while autograd computes that bucket. The order of collectives stays fixed
    on every rank: this bucket's all-to-all, then (next hook) its all-gather, then the next
    bucket's. Never for the last bucket of a backward pass (nothing would follow it)."""
    if state.twophase is None:
        state.twophase = TwoPhaseState(seed=state.seed, world_size=state.world_size)
    tensors = []
    for i in indices:
        piece = pieces[i]
        flat = piece.flat if piece.flat.dtype == torch.float32 else piece.flat.float()
        owed = state.residuals.pop(piece.name, None)  # what another route left: sent now
        if owed is not None and state.pipeline.error_feedback:
            flat.add_(owed)
        route = routes[i]
        assert isinstance(route, TwoPhase)
        tensors.append((piece.name, flat, route))
    started = start(
        tensors,
        state.twophase,
        group=state.process_group,
        error_feedback=state.pipeline.error_feedback,
        generators=state.generator_for,
    )
    state.count(sent_bytes=started.bytes_sent, dense_bytes=0)
    done: list[Exchange] = []

    def finish() -> None:
        done[0].finish()
        for i, (_, flat, _) in zip(indices, tensors, strict=True):
            if flat is not pieces[i].flat:  # a bucket of another dtype: written back
                pieces[i].flat.copy_(flat)

    finishers.append(finish)
    if not defer:
        done.append(complete(started))
        return done[0].future
    result: Future = torch.futures.Future()
    state.deferred.append((started, result, done))
    return result


def flush_twophase(state: CompressionState) -> None:
    """Run the second phase of a deferred exchange (see :func:`twophase_reduce`): called by
    the hook before anything else, so the all-gather precedes this bucket's collectives."""
    while state.deferred:
        started, result, done = state.deferred.pop(0)
        exchanged = complete(started)
        done.append(exchanged)

        def relay(finished: Future, result: Future = result) -> None:
            try:
                result.set_result(finished.value())
            except Exception as error:  # noqa: BLE001 - the collective's error, passed on
                result.set_exception(error)

        exchanged.future.then(relay)
