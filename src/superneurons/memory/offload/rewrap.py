"""A ``DistributedDataParallel`` built before the host optimizer's plan, rebuilt in place.

The host optimizer reduces its own gradient buckets (:mod:`.host_buckets`): DDP must hold
none, which it does when the plan is applied before the model is wrapped (DDP then ignores all
parameters but one, ``_ddp_params_and_buffers_to_ignore``). ``transformers.Trainer`` and
``accelerate`` wrap the model before any callback runs, and keep the wrapper in places no
callback can reach (a local variable of ``Trainer._inner_training_loop``). So the wrapper is
kept and its insides replaced: a new ``DistributedDataParallel`` is constructed around the same
module with the same options (now ignoring all parameters but one), and the old object takes
over its attributes. The old reducer goes with its old attributes: its gradient buckets (one
copy of every gradient, for the whole run) are freed and its autograd hooks removed
(``Reducer``'s destructor). :func:`rebuild_in_place` returns the undo, which rebuilds it again
from the module's ignore list at that time (the original one, once the plan is removed).

The new DDP is constructed without the collectives of DDP's constructor where the torch has
the switch (:func:`superneurons.compat.data_parallel_without_init_sync`): the replicas already
agree, and the host optimizer broadcasts the ignored parameters itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from superneurons.compat import data_parallel_without_init_sync
from superneurons.errors import ConfigError

__all__ = ["rebuild_in_place"]

# DDP's options that a rebuild carries over, read from the instance (attribute names)
_OPTIONS = (
    "device_ids",
    "output_device",
    "dim",
    "process_group",
    "find_unused_parameters",
    "gradient_as_bucket_view",
    "static_graph",
)


def rebuild_in_place(ddp: DistributedDataParallel) -> Callable[[], None]:
    """Rebuild ``ddp`` around its module, whose ignore list now names the parameters DDP must
    leave alone; returns the function that rebuilds it again (for the undo).

    Raises:
        ConfigError: DDP runs mixed precision, delays all-reduces of named parameters, or has a
            communication hook registered already (register it after the plan instead, e.g.
            ``prepare_superneurons(compression=...)``).
    """
    _check_rebuildable(ddp)
    options: dict[str, Any] = {name: getattr(ddp, name) for name in _OPTIONS}
    options["bucket_cap_mb"] = ddp.bucket_bytes_cap / 2**20
    # NOTE: broadcast_buffers is spelled forward_sync_buffers in newer torch; read by name, the
    # attribute of the torch that built ``ddp``
    if hasattr(ddp, "forward_sync_buffers"):
        options["forward_sync_buffers"] = getattr(ddp, "forward_sync_buffers")  # noqa: B009
    else:
        options["broadcast_buffers"] = getattr(ddp, "broadcast_buffers")  # noqa: B009
    extras: dict[str, Any] | None = None  # what others set on the wrapper (kept throughout)

    def rebuild() -> None:
        nonlocal extras
        fresh = data_parallel_without_init_sync(ddp.module, **options)
        if extras is None:
            extras = {k: v for k, v in ddp.__dict__.items() if k not in fresh.__dict__}
        ddp.__dict__.clear()  # the old reducer, its buckets and hooks go here
        ddp.__dict__.update(fresh.__dict__)
        ddp.__dict__.update(extras)

    rebuild()
    return rebuild


def _check_rebuildable(ddp: DistributedDataParallel) -> None:
    if getattr(ddp, "mixed_precision", None) is not None:
        raise ConfigError(
            "DistributedDataParallel(mixed_precision=...) casts parameters itself: the host "
            "optimizer keeps fp32 masters instead; construct DDP without it"
        )
    if getattr(ddp, "_delay_all_reduce_params", None):
        raise ConfigError(
            "DistributedDataParallel delays the all-reduce of some parameters "
            "(delay_all_reduce_named_params): not combined with the host optimizer"
        )
    if getattr(ddp, "_comm_hooks", None):
        raise ConfigError(
            "a communication hook was registered on the DDP model before the host optimizer's "
            "plan: register it after (prepare_superneurons(compression=...) does), so that it "
            "runs on the host optimizer's buckets"
        )
