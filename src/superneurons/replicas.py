"""Data-parallel replicas start training from the same state, or training stops with a name.

Under data parallelism every rank holds a full replica: its parameters, buffers and optimizer
state must be equal when training starts, and DDP keeps them equal only from there on (it
averages gradients; it broadcasts parameters and buffers once, at construction, never the
optimizer's state). A replica changed after that (a setup step run on one rank only, an
optimizer state loaded from another rank's file, a seed that differs) trains a different model
without any error: the logged loss is the cross-rank mean and looks normal.

:func:`check_replicas` compares them once, after setup: each rank fingerprints every tensor on
its device (a position-weighted int64 sum of the raw bits: exact, independent of reduction
order, sensitive to any changed bit and to swapped elements), the fingerprints are all-gathered
in one collective, and every rank raises the same :class:`~superneurons.errors.ReplicaMismatchError`
naming the first tensor that differs. Cost: one pass over the state (no copy of it) and a
message of 8 bytes plus a name per tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from superneurons.errors import ReplicaMismatchError

__all__ = ["check_replicas", "fingerprints"]

logger = logging.getLogger("superneurons.replicas")

_CHUNK = 1 << 22  # elements per weighted sum: bounds the int64 temporaries to 32 MiB
_PERIOD = 65521  # weights 1..65521 (the largest prime below 2**16) repeat along the tensor
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """sum_i bits[i] * (i mod P + 1) as an int64 on the tensor's device (wrapping, exact)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    size = flat.element_size()
    bits = flat.view(_BITS[size]) if size in _BITS else flat.view(torch.int64)
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=bits.device) % _PERIOD + 1
        total += (chunk * weights).sum()
    return total


def _named_state(model: nn.Module, optimizers: Sequence[Any]) -> list[tuple[str, Any]]:
    """(name, tensor or plain value) for everything a replica holds, in a rank-independent order."""
    named: list[tuple[str, Any]] = [*model.named_parameters(), *model.named_buffers()]
    names = {id(p): n for n, p in model.named_parameters()}
    for index, optimizer in enumerate(optimizers):
        label = f"optimizer{index}" if len(optimizers) > 1 else "optimizer"
        for group_index, group in enumerate(optimizer.param_groups):
            hyper = sorted((k, repr(v)) for k, v in group.items() if k != "params")
            named.append((f"{label}.param_groups[{group_index}]", repr(hyper)))
            for position, param in enumerate(group["params"]):
                name = names.get(id(param), f"param_groups[{group_index}][{position}]")
                for key, value in sorted(optimizer.state.get(param, {}).items()):
                    named.append((f"{label}.state[{name}].{key}", value))
    return named


def fingerprints(model: nn.Module, *, optimizers: Sequence[Any] = ()) -> dict[str, int | str]:
    """Every tensor's fingerprint by name (parameters, buffers, optimizer state); the ``repr`` of
    plain values (hyper-parameters of each param group, Python numbers in the state)."""
    named = _named_state(model, [_inner(o) for o in optimizers])
    tensors = [(n, v) for n, v in named if isinstance(v, torch.Tensor)]
    values: dict[str, int | str] = {}
    if tensors:
        # one transfer per device: the sums stay on the device until stacked
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in tensors:
            by_device.setdefault(tensor.device, []).append((name, _fingerprint(tensor)))
        for rows in by_device.values():
            sums = torch.stack([s for _, s in rows]).tolist()
            values.update({name: int(s) for (name, _), s in zip(rows, sums, strict=True)})
    for name, value in named:
        if not isinstance(value, torch.Tensor):
            values[name] = repr(value)  # NOTE: not hash(): str hashes differ across processes
    return {name: values[name] for name, _ in named}


def check_replicas(
    model: nn.Module,
    *,
    optimizers: Sequence[Any] = (),
    process_group: Any = None,
    when: str = "after setup",
) -> None:
    """Raise on every rank unless all ranks hold the same parameters, buffers and optimizer state.

    Collective over ``process_group`` (default: the world); a no-op without an initialised
    group or with one rank.

    Args:
        model: the replica (a DDP wrapper is fine: its ``module`` is compared, under the same names).
        optimizers: the optimizers stepping it (wrappers such as accelerate's are unwrapped).
        process_group: the data-parallel group (a DDP model's ``process_group``).
        when: the moment, for the message (``"after setup"``).

    Raises:
        ReplicaMismatchError: a tensor (or the set of tensors) differs between two ranks.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_world_size(process_group) < 2:
        return
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    mine = fingerprints(model, optimizers=optimizers)
    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    # NOTE: all_gather_object sends sizes first, so ranks holding different sets of tensors
    # still complete the collective (and then disagree below) instead of hanging.
    dist.all_gather_object(gathered, mine, group=process_group)
    reference = gathered[0]
    for rank, theirs in enumerate(gathered[1:], start=1):
        if theirs == reference:
            continue
        if list(theirs) != list(reference):
            extra = sorted(set(theirs) ^ set(reference))[:3]
            raise ReplicaMismatchError(
                f"ranks hold different sets of tensors {when}: rank 0 and rank {rank} differ in "
                f"{extra or 'their order'}; build the same model and optimizer on every rank"
            )
        differ = [name for name in reference if reference[name] != theirs[name]]
        more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
        raise ReplicaMismatchError(
            f"ranks hold different training state {when}: {differ[0]!r}{more} differs between "
            f"rank 0 and rank {rank}, so they would silently train different models; every rank "
            "must start from the same weights and optimizer state (seed before building the "
            "model, load the same checkpoint on every rank)"
        )
    logger.debug("%d ranks hold the same %d tensors %s", len(gathered), len(reference), when)


def _inner(optimizer: Any) -> Any:
    """The optimizer holding the state (accelerate's and Lightning's wrappers unwrapped)."""
    from superneurons.memory.offload.handover import inner_optimizer

    return inner_optimizer(optimizer)
