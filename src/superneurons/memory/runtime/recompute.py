"""Cost-aware recomputation of one unit: non-reentrant checkpoint with BatchNorm run once.

SuperNeurons (Wang et al., PPoPP'18, arXiv 1801.04380, section 3.3) drops the outputs of cheap
layers in forward and recomputes them in backward from the nearest checkpoint. In eager
PyTorch the unit's forward runs under *non-reentrant* :func:`torch.utils.checkpoint.checkpoint`
(``use_reentrant=False``), which

* saves only the unit's inputs and recomputes lazily when backward first unpacks a dropped
  tensor, stopping as soon as every needed tensor exists (``set_checkpoint_early_stop(True)``);
* replays the CPU (and CUDA) RNG state, so dropout masks equal the original pass
  (``preserve_rng_state=True``), and the autocast state;
* works under DDP (the reentrant variant does not: it hides parameters from the reducer).

Plain checkpointing runs BatchNorm twice in training mode, so ``running_mean``/``running_var``
move twice and ``num_batches_tracked`` grows by two per step (pytorch#96136, still open;
measured here). :func:`checkpointed_forward` detects the recompute pass through the second
context manager of ``context_fn``; in training mode BatchNorm normalises with the batch
statistics of the (identical) input, exactly as the first pass did; the layers' running buffers
are snapshotted before the recompute and written back after it, so running statistics and
``num_batches_tracked`` are updated exactly once per step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from superneurons.compat import compiler_disabled
from superneurons.errors import ConfigError

__all__ = ["RecomputeStats", "checkpointed_forward", "norm_layers", "running_stat_bytes"]


class RecomputeStats:
    """Counts of the forward and recompute passes one wrapped unit ran (explicit state)."""

    def __init__(self) -> None:
        self.forward_calls = 0
        self.recompute_calls = 0

    def state_dict(self) -> dict[str, int]:
        return {"forward_calls": self.forward_calls, "recompute_calls": self.recompute_calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.forward_calls = int(state["forward_calls"])
        self.recompute_calls = int(state["recompute_calls"])


def norm_layers(module: nn.Module) -> list[_NormBase]:
    """BatchNorm/SyncBatchNorm/InstanceNorm layers inside ``module`` that keep running stats."""
    return [m for m in module.modules() if isinstance(m, _NormBase) and m.track_running_stats]


def running_stat_bytes(module: nn.Module) -> int:
    """Bytes the recompute pass snapshots for ``module``'s training-mode norm layers."""
    touched = [m for m in norm_layers(module) if m.training]
    return sum(b.untyped_storage().nbytes() for m in touched for b in _running_buffers(m))


@contextlib.contextmanager
def _frozen_running_stats(norms: list[_NormBase], stats: RecomputeStats) -> Iterator[None]:
    """During the recompute pass: same batch statistics, running stats left as they were."""
    stats.recompute_calls += 1
    # NOTE: the layer must run with its running buffers attached (it saves them for backward
    # and checkpoint checks that the recompute saves as many tensors as the forward did), so
    # the buffers are snapshotted and written back instead (pytorch#96136). Only layers in
    # training mode update statistics; eval-mode layers merely read them.
    touched = [m for m in norms if m.training]
    with torch.no_grad():
        saved = [[b.clone() for b in _running_buffers(m)] for m in touched]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, snapshot in zip(touched, saved, strict=True):
                for buffer, value in zip(_running_buffers(m), snapshot, strict=True):
                    buffer.copy_(value)


def _running_buffers(module: _NormBase) -> list[torch.Tensor]:
    names = ("running_mean", "running_var", "num_batches_tracked")
    return [b for b in (getattr(module, n, None) for n in names) if isinstance(b, torch.Tensor)]


def checkpointed_forward(
    module: nn.Module,
    forward: Callable[..., Any],
    stats: RecomputeStats,
    *,
    also: Sequence[nn.Module] = (),
) -> Callable[..., Any]:
    """Return a forward for ``module`` that runs ``forward`` under non-reentrant checkpoint.

    ``forward`` is the module's original (bound) forward, or for a segment the chain of its
    members; ``also`` names the other modules whose normalisation layers ``forward`` runs.
    Under ``torch.no_grad()`` (e.g. evaluation) the unit runs plainly: nothing to recompute.
    """
    norms = [n for m in (module, *also) for n in norm_layers(m)]
    # NOTE: a raise in traced code makes dynamo run the frame again eagerly
    # (memory.runtime.compiled): the refusal must be a dynamo-disabled call, made here, outside
    # traced code
    refuse = compiler_disabled(_refuse_norms, reason=_NORMS_UNDER_COMPILE) if norms else None

    def context_fn() -> tuple[contextlib.AbstractContextManager[None], Any]:
        return contextlib.nullcontext(), _frozen_running_stats(norms, stats)

    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            if refuse is not None:
                refuse()
            return _traced(forward, *args, **kwargs)
        stats.forward_calls += 1
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        # NOTE: every tensor input goes to checkpoint positionally, so that it is saved
        # through the saved-tensor hooks (and the tensor pool can move it, as the planner
        # assumes); a tensor in the keyword arguments (Hugging Face passes the rotary
        # embeddings so) would otherwise stay on the device, referenced by a closure
        leaves, spec = tree_flatten((args, kwargs))
        where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        template = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]

        def run(*tensors: torch.Tensor) -> Any:
            filled = list(template)
            for i, tensor in zip(where, tensors, strict=True):
                filled[i] = tensor
            call_args, call_kwargs = tree_unflatten(filled, spec)
            return forward(*call_args, **call_kwargs)

        tensors = [leaves[i] for i in where]
        del leaves
        with set_checkpoint_early_stop(True):
            return checkpoint(
                run,
                *tensors,
                use_reentrant=False,
                preserve_rng_state=True,
                context_fn=context_fn,
            )

    return wrapped


_NORMS_UNDER_COMPILE = (
    "a recompute unit with BatchNorm layers cannot run under torch.compile (its running "
    "statistics are kept exact by a context dynamo does not trace): run it eagerly, or give the "
    "unit 'keep'"
)


def _refuse_norms() -> None:
    raise ConfigError(_NORMS_UNDER_COMPILE)


def _traced(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Under ``torch.compile``: the plain non-reentrant checkpoint dynamo traces into one graph
    (its ``tag_activation_checkpoint``; early stop is the default). No counters, no contexts."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
