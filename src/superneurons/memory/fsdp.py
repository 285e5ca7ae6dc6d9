"""FSDP2 (``torch.distributed.fsdp.fully_shard``) models in the memory planner, one plan per rank.

A model whose blocks (and root) are ``fully_shard``-ed is profiled, planned and run per rank,
on the rank's own shards, with three differences from a replicated model:

* **Isolation by snapshot.** FSDP2 keeps each sharded parameter in its ``FSDPParam`` and
  re-registers the sharded or the unsharded parameter on the module around every forward
  (``_setattr_on_modules``): a clone swapped into ``module._parameters`` would be overwritten by
  the first unshard, and the gradients and the optimizer step would land on the originals. So
  the profiled step runs on the real parameters: :func:`sharded_isolated` copies this rank's
  local shards, takes their gradients off (FSDP2 accumulates into an existing sharded
  gradient in place), steps a shadow optimizer (:func:`~.isolate.shadow_optimizer`, its state
  cloned) on the real parameters, and writes the shards, buffers and gradients back after.
* **Unsharded parameters are parameters.** FSDP2 all-gathers a block's parameters before its
  forward and frees them with ``storage.resize_(0)`` after it (and again around its backward);
  the tracker follows those resizes (:mod:`.tracker`). :func:`count_unsharded_params` makes
  the profile count those storages as parameters, not as the block's saved activations: a
  recompute plan cannot drop them, FSDP2's reshard already does.
* **One plan for the group.** Ranks time their CPU work differently, and cost-aware planning
  may break ties differently: :func:`agree_plan` gives every rank rank 0's plan (the ranks'
  profiles hold the same units; a rank that failed to plan makes every rank raise, so no
  rank is left waiting in a collective).

Only ``keep`` and ``recompute`` run on a sharded model (:func:`check_sharded_plan`): FSDP2
applies activation checkpointing around its own unshard/reshard hooks (the pre-backward hook
all-gathers a block's parameters before its recompute runs; torchtitan checkpoints blocks
before ``fully_shard``; PyTorch's private ``auto_sac`` plans recompute only).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from superneurons.compat import fsdp_module_class
from superneurons.errors import ConfigError
from superneurons.memory.plan import Plan
from superneurons.memory.tracker import LiveStorageTracker

__all__ = [
    "agree_plan",
    "check_sharded_plan",
    "count_unsharded_params",
    "is_fully_sharded",
    "sharded_isolated",
    "with_lineage",
]

logger = logging.getLogger("superneurons.memory")


def is_fully_sharded(model: nn.Module) -> bool:
    """Whether ``model`` or one of its submodules is ``fully_shard``-ed (FSDP2)."""
    fsdp_module = fsdp_module_class()
    return fsdp_module is not None and any(isinstance(m, fsdp_module) for m in model.modules())


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``param`` (the tensor itself when it is not a DTensor); call under
    ``no_grad``, where ``DTensor.to_local()`` aliases the shard instead of copying it."""
    to_local = getattr(param, "to_local", None)
    return to_local() if callable(to_local) else param


@contextlib.contextmanager
def sharded_isolated(
    root: nn.Module, shadow: torch.optim.Optimizer | None
) -> Iterator[tuple[nn.Module, torch.optim.Optimizer | None]]:
    """Yield ``(root, shadow)`` to run one training step of a ``fully_shard``-ed model on; on
    exit the rank's shards, buffers and gradients and the RNG are as they were.

    ``shadow`` is a copy of the optimizer that steps ``root``'s own parameters (its state
    cloned: :func:`~.isolate.shadow_optimizer` with a memo mapping each parameter to itself).
    Costs a copy of this rank's shards, buffers and optimizer state, as a replicated model's
    isolation does (:func:`~.isolate.isolated`).
    """
    params = list({id(p): p for p in root.parameters()}.values())
    buffers = list({id(b): b for b in root.buffers()}.values())
    with torch.no_grad():
        shards = [_local(p).clone() for p in params]
        buffer_values = [b.clone() for b in buffers]
    grads = [p.grad for p in params]
    try:
        for param in params:
            param.grad = None
        devices = sorted({p.device for p in params if p.device.type == "cuda"}, key=str)
        with torch.random.fork_rng(devices=devices):
            yield root, shadow
    finally:
        with torch.no_grad():
            for param, shard in zip(params, shards, strict=True):
                _local(param).copy_(shard)
            for buffer, value in zip(buffers, buffer_values, strict=True):
                buffer.copy_(value)
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad


def count_unsharded_params(model: nn.Module, tracker: LiveStorageTracker, owned: set[int]) -> Any:
    """Add the storages of the parameters each FSDP2 module holds right after its pre-forward
    hook (the unsharded ones) to ``owned`` (the profile's parameter storages); returns the hook
    handles. Run after FSDP2's own pre-forward hook, which is registered with ``prepend``."""
    fsdp_module = fsdp_module_class()

    def mark(module: nn.Module, _args: Any) -> None:
        for param in module.parameters():
            serial = tracker.serial_of(param)
            if serial is not None:
                owned.add(serial)

    return [
        module.register_forward_pre_hook(mark)
        for module in model.modules()
        if fsdp_module is not None and isinstance(module, fsdp_module)
    ]


def with_lineage(tracker: LiveStorageTracker, serials: set[int]) -> set[int]:
    """``serials`` and every other serial of the same storages (their resized lives)."""
    roots = {tracker.lineage.get(s, s) for s in serials}
    return {s for s in tracker.nbytes if tracker.lineage.get(s, s) in roots}


def check_sharded_plan(model: nn.Module, plan: Plan) -> None:
    """Raise unless ``plan`` runs on the ``fully_shard``-ed ``model`` (keep and recompute).

    Raises:
        ConfigError: the plan offloads, or moves the optimizer into backward or to the host.
    """
    offloaded = [u.fqn for u in plan.units if "offload" in u.action]
    if offloaded or plan.optimizer_in_backward or plan.host_optimizer:
        what = f"offloads {offloaded[:3]}" if offloaded else "moves the optimizer"
        raise ConfigError(
            f"this plan {what}, which a fully_shard (FSDP2) model does not support here: plan it "
            "with strategy='recompute' (FSDP2 already shards parameters, gradients and optimizer "
            "state; use fully_shard's own offload_policy=CPUOffloadPolicy() to move them)"
        )


def agree_plan(
    plan: Plan | None,
    *,
    error: BaseException | None = None,
    group: dist.ProcessGroup | None = None,
) -> Plan:
    """Every rank of ``group`` (default: the world) gets the plan of the group's first rank.

    Call it on every rank, with this rank's plan, or with ``error`` where planning raised: the
    ranks first exchange what they planned (the units' fqns, or the error), so that a rank
    that failed, or planned other units, makes every rank raise instead of leaving the others
    waiting in the broadcast. Without an initialised process group it returns ``plan`` (or
    raises ``error``).

    Raises:
        ConfigError: the ranks planned different units (a different model or ``units=``), or
            another rank failed to plan (its message); ``error`` itself on the rank it came from.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        assert plan is not None
        return plan
    world = dist.get_world_size(group)
    mine: tuple[str, Any] = (
        ("error", f"{type(error).__name__}: {error}")
        if error is not None or plan is None
        else ("units", tuple(u.fqn for u in plan.units))
    )
    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, mine, group=group)
    if error is not None:
        raise error
    failed = [(rank, text) for rank, (kind, text) in enumerate(seen) if kind == "error"]
    if failed:
        rank, text = failed[0]
        raise ConfigError(f"rank {rank} of the group could not plan its step ({text})")
    differing = [rank for rank, entry in enumerate(seen) if entry != seen[0]]
    if differing:
        raise ConfigError(
            f"ranks {differing} planned other units than rank 0 ({len(seen[differing[0]][1])} vs "
            f"{len(seen[0][1])}): build the same model, and pass the same units=, on every rank"
        )
    box: list[Any] = [plan]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    agreed: Plan = box[0]
    if agreed != plan:
        logger.info("rank 0's plan replaces this rank's (%s)", agreed.strategy)
    return agreed
