"""A set-up that fails leaves no trace on the user's model.

Setting a plan up changes the user's model in place, step by step: HF's activation checkpointing
off, ``use_cache`` off, ``forward`` attributes replaced (recompute, the chunked head), hooks
registered, the optimizer handed over. Each step enters its own undo as it goes
(:class:`~superneurons.integrations.accelerate.SuperNeuronsSetup`'s stack, ``apply_plan``'s
handle); :func:`no_trace` is the second guard around the whole set-up: it records what any
step may change and, when the set-up raises, undoes the steps (``undo``) and then puts back
whatever still differs, so the model is exactly as it was before the call, whatever step failed:

* every module's instance-level ``forward`` (present or not, and which), its ``training`` flag,
  HF's checkpointing attributes (``gradient_checkpointing``, ``_gradient_checkpointing_func``)
  and its hook dictionaries (forward, forward-pre, backward, state-dict hooks);
* every parameter's ``requires_grad``;
* ``config.use_cache`` of every module with a config.

Parameters, buffers and the optimizer are never written by set-up (profiles are isolated:
:mod:`superneurons.memory.profiling.isolate`); a DDP comm hook cannot be unregistered, so set-up
registers it last, when nothing after it can fail.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["ModelSnapshot", "no_trace"]

_ABSENT = object()
# Module attributes set-up may set or replace (HF's checkpointing ones: transformers 4.35-5.x).
_ATTRIBUTES = ("forward", "training", "gradient_checkpointing", "_gradient_checkpointing_func")
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


@dataclass
class _ModuleState:
    module: nn.Module
    attributes: dict[str, Any]
    hooks: dict[str, OrderedDict[Any, Any]]
    use_cache: Any


class ModelSnapshot:
    """What set-up may change on ``model`` (module docstring), recorded now;
    :meth:`restore` puts it back, :meth:`differences` names what differs."""

    def __init__(self, model: nn.Module) -> None:
        self.rows = [_state_of(m) for m in _modules(model)]
        self.requires_grad = [(p, p.requires_grad) for p in model.parameters()]

    def restore(self) -> None:
        for row in self.rows:
            own = vars(row.module)
            for name, value in row.attributes.items():
                if value is _ABSENT:
                    own.pop(name, None)
                else:
                    own[name] = value
            for name, hooks in row.hooks.items():
                setattr(row.module, name, OrderedDict(hooks))
            config = getattr(row.module, "config", None)
            if row.use_cache is not _ABSENT and config is not None:
                config.use_cache = row.use_cache
        for param, flag in self.requires_grad:
            param.requires_grad_(flag)

    def differences(self) -> list[str]:
        """What differs from the recorded state, one line each (``[]``: nothing)."""
        now = {id(r.module): r for r in (_state_of(row.module) for row in self.rows)}
        found = []
        for row in self.rows:
            current = now[id(row.module)]
            name = type(row.module).__name__
            for key, value in row.attributes.items():
                if current.attributes[key] is not value:
                    found.append(f"{name}.{key}")
            for key, hooks in row.hooks.items():
                if list(current.hooks[key].items()) != list(hooks.items()):
                    found.append(f"{name}.{key}")
            if current.use_cache != row.use_cache:
                found.append(f"{name}.config.use_cache")
        found += [
            f"requires_grad of a {tuple(p.shape)} parameter"
            for p, flag in self.requires_grad
            if p.requires_grad != flag
        ]
        return found


@contextmanager
def no_trace(*models: nn.Module, undo: Callable[[], Any] | None = None) -> Iterator[None]:
    """Run a set-up of ``models``; if it raises, call ``undo()`` (its own undo stack) and then
    restore each model exactly as it was on entry (module docstring), and re-raise."""
    snapshots = [ModelSnapshot(model) for model in models]
    try:
        yield
    except BaseException:
        try:
            if undo is not None:
                undo()
        finally:
            for snapshot in snapshots:
                snapshot.restore()
        raise


def _modules(model: nn.Module) -> list[nn.Module]:
    seen: dict[int, nn.Module] = {}
    for module in model.modules():
        seen.setdefault(id(module), module)
    return list(seen.values())


def _state_of(module: nn.Module) -> _ModuleState:
    own = vars(module)
    attributes = {name: own.get(name, _ABSENT) for name in _ATTRIBUTES}
    hooks = {name: OrderedDict(own[name]) for name in _HOOK_DICTS if name in own}
    config = own.get("config")
    use_cache = getattr(config, "use_cache", _ABSENT) if config is not None else _ABSENT
    return _ModuleState(module, attributes, hooks, use_cache)
