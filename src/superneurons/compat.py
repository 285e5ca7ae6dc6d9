"""The torch calls whose spelling differs across the supported range (torch >= 2.4): one place.

Everything else in the package uses only APIs that torch 2.4 already has; ``tests/
test_torch_range.py`` checks that against an inventory read from the torch 2.4.1 wheel, and
exempts this module alone. Each function here prefers the current public API and falls back to
the older spelling, so callers never test versions themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "all_gather_into_tensor",
    "compiler_disabled",
    "custom_op_function",
    "data_parallel_without_init_sync",
    "fake_cache_disabled",
    "fsdp_module_class",
    "memory_fraction",
    "native_linear_cross_entropy",
    "selective_checkpoint_contexts",
]


def selective_checkpoint_contexts(must_save: Callable[[Any], bool]) -> Any:
    """The ``context_fn`` pair of non-reentrant ``torch.utils.checkpoint`` that keeps the
    outputs of the ops for which ``must_save(op)`` is true and recomputes all others
    (selective activation checkpointing, as in Megatron-LM's selective recompute).

    torch >= 2.5: ``create_selective_checkpoint_contexts`` with ``CheckpointPolicy``; torch 2.4:
    the same dispatch-mode mechanism under its earlier private name, whose policy returns a
    bool (True = save).
    """
    try:
        from torch.utils.checkpoint import (  # type: ignore[attr-defined]
            CheckpointPolicy,
            create_selective_checkpoint_contexts,
        )
    except ImportError:  # torch 2.4
        from torch.utils.checkpoint import (  # type: ignore[attr-defined]
            _pt2_selective_checkpoint_context_fn_gen,
        )

        return _pt2_selective_checkpoint_context_fn_gen(
            lambda _mode, op, *_args, **_kwargs: must_save(op)
        )

    def policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if must_save(op) else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def memory_fraction(device: Any = None) -> float:
    """The caching allocator's per-process memory fraction on ``device``.

    torch >= 2.7 reads it back with ``torch.cuda.get_per_process_memory_fraction``; older torch
    has only the setter, so the default (1.0, no cap) is returned there — the value unless
    someone called ``set_per_process_memory_fraction`` outside superneurons.
    """
    import torch

    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is None:
        return 1.0
    return float(getter(device) if device is not None else getter())


def all_gather_into_tensor(
    output: Any, input: Any, *, group: Any = None, async_op: bool = False
) -> Any:
    """Gather every rank's ``input`` into ``output`` (rank-major, equal sizes), one collective.

    torch >= 2.13 names it ``all_gather_single`` and warns on ``all_gather_into_tensor``;
    torch 1.13 to 2.12 have only ``all_gather_into_tensor``. Same semantics either way.
    """
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


@contextmanager
def fake_cache_disabled(fake_mode: Any) -> Iterator[None]:
    """``fake_mode``'s dispatch cache switched off inside the block.

    ``torch._subclasses.fake_tensor.disable_fake_tensor_cache`` is recent; every supported torch
    keeps the switch as ``FakeTensorMode.cache_enabled``, which is what that helper flips. A mode
    without the attribute has no cache to switch off.
    """
    if not hasattr(fake_mode, "cache_enabled"):
        yield
        return
    old: bool = fake_mode.cache_enabled
    fake_mode.cache_enabled = False
    try:
        yield
    finally:
        fake_mode.cache_enabled = old


def native_linear_cross_entropy() -> tuple[Callable[..., Any], Any] | None:
    """``(torch.nn.functional.linear_cross_entropy, torch.nn.LinearCrossEntropyOptions)``: the
    chunked linear cross-entropy PyTorch ships from 2.13 on (pure PyTorch, pytorch#175039 and
    follow-ups); ``None`` on an older torch, whose callers use their own chunked loop."""
    import torch

    function = getattr(torch.nn.functional, "linear_cross_entropy", None)
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if function is None or options is None:
        return None
    return function, options


def custom_op_function(func: Any) -> Callable[..., Any] | None:
    """The Python function behind ``func`` when it is an operator defined with
    ``torch.library.custom_op`` (its one implementation, made of ordinary torch ops), else None.

    A dispatch mode sees such an operator as one op; calling this function inside the mode
    instead lets it see the operator's own buffers (``memory.tracker``)."""
    try:
        from torch._library.custom_ops import _maybe_get_opdef
    except ImportError:  # no custom_op registry in this torch
        return None
    name = getattr(func, "_name", None)
    if not isinstance(name, str) or name.startswith(("aten::", "prim::", "prims::")):
        return None
    opdef = _maybe_get_opdef(name)
    function = getattr(opdef, "_init_fn", None)
    return function if callable(function) else None


def compiler_disabled(fn: Callable[..., Any], *, reason: str) -> Callable[..., Any]:
    """``fn`` wrapped in ``torch.compiler.disable``: dynamo breaks the graph before a call and
    runs it eagerly. ``reason`` goes into dynamo's graph-break message where the torch takes it
    (the keyword is newer than torch 2.4)."""
    import inspect

    import torch

    if "reason" in inspect.signature(torch.compiler.disable).parameters:
        return torch.compiler.disable(fn, reason=reason)  # type: ignore[call-arg,no-any-return]
    return torch.compiler.disable(fn)  # type: ignore[no-any-return]


def fsdp_module_class() -> type | None:
    """FSDP2's ``FSDPModule`` (every ``fully_shard``-ed module is one), or None where
    ``torch.distributed`` is not built.

    torch >= 2.6: ``torch.distributed.fsdp``; torch 2.4 and 2.5: ``torch.distributed.
    _composable.fsdp``.
    """
    try:
        from torch.distributed.fsdp import FSDPModule  # type: ignore[attr-defined]
    except ImportError:
        try:  # torch 2.4, 2.5
            from torch.distributed._composable.fsdp import FSDPModule  # type: ignore[no-redef]
        except ImportError:  # builds without torch.distributed
            return None
    return FSDPModule  # type: ignore[no-any-return]


def data_parallel_without_init_sync(module: Any, **options: Any) -> Any:
    """``DistributedDataParallel(module, **options)`` without the collectives its constructor
    runs (the parameter-shape check, rank 0's parameters and buffers broadcast), for a module
    whose replicas already agree.

    torch >= 2.6 takes ``init_sync=False`` (pytorch#142824); older torch has no such switch
    and runs the collectives, so every rank must construct it at the same point.
    """
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    if "init_sync" in inspect.signature(DistributedDataParallel).parameters:
        options["init_sync"] = False
    return DistributedDataParallel(module, **options)
