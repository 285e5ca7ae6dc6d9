"""Stateful forwards under a plan: third-party key/value caches and modules that write state.

A plan re-runs a ``recompute`` unit's forward in backward and moves an ``offload`` unit's saved
tensors to the host. Both assume the forward is a pure function of its inputs and parameters.
Two kinds of forward break that assumption:

* **A key/value cache** (Hugging Face ``transformers``: ``use_cache=True`` is the default of
  GPT-2 and most decoders, also in training). Each attention layer appends its keys and values
  to a ``Cache`` object that outlives the layer. A recompute appends them a second time (the
  cache then holds 2T positions: a CUDA run of GPT-2 crashed on "2048 vs 1024"), and
  the cache keeps every layer's keys and values on the device, so neither recompute nor offload
  frees them (measured here on a tiny GPT-2: a 0.40 budget ran 1.5% over it, the prediction
  6% low). :func:`guard_stateful_forwards` does what HF's own gradient checkpointing does
  (``transformers.modeling_layers.GradientCheckpointingLayer`` and
  ``utils.generic.merge_with_config_defaults``): in training with gradients it calls the model
  with ``use_cache=False`` and logs it once; evaluation and ``generate`` keep the cache. A unit
  that still receives a ``Cache`` (a caller passing ``past_key_values`` in training) is refused.
* **Any other state written in forward**: a buffer mutated in place, a tensor or a counter
  bound to a module attribute. A recompute would write it twice (as plain checkpointing does to
  BatchNorm's running statistics, pytorch#96136; the runtime restores those itself:
  :mod:`superneurons.memory.runtime.recompute`), and a tensor kept on a module pins device memory an
  offload meant to free. Such a unit is refused at its first training forward with a
  :class:`~superneurons.errors.ConfigError` that names the module and the attribute (checked
  on the first training forwards: a forward that writes state does so at once).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._pytree import tree_flatten

from superneurons.errors import ConfigError

if TYPE_CHECKING:
    from superneurons.memory.plan import Plan

__all__ = ["guard_stateful_forwards", "is_kv_cache", "kv_cache_off"]

logger = logging.getLogger("superneurons.memory")

# BatchNorm statistics: the runtime updates them once per step (recompute.py).
_NORM_BUFFERS = frozenset({"running_mean", "running_var", "num_batches_tracked"})
# Module attributes that are not state a forward writes.
_IGNORED = frozenset({"forward", "training"})
# NOTE: the state check walks every module of the non-keep units (~1 ms for ResNet-50's 150);
# it runs on the first training forwards only, where a stateful forward shows itself.
STATE_CHECKS = 2
_Snapshot = dict[tuple[str, str], tuple[int, int, Any]]


def is_kv_cache(value: Any) -> bool:
    """True for a ``transformers`` ``Cache`` (checked by class name: transformers stays
    optional)."""
    return any(
        cls.__name__ == "Cache" and cls.__module__.startswith("transformers")
        for cls in type(value).__mro__
    )


def guard_stateful_forwards(model: nn.Module, plan: Plan) -> list[Any]:
    """Make ``model`` safe to run under ``plan``; returns removable hook handles.

    Installs :func:`kv_cache_off`; and when some unit is not ``keep``, a pre-hook on every
    non-keep unit that refuses a ``Cache`` argument and a model-level pair of hooks that refuses
    a forward writing state inside a non-keep unit (checked on the first ``STATE_CHECKS``
    training forwards). The caller removes the handles when the plan is removed.
    """
    handles = kv_cache_off(model)
    active = {u.fqn: u.action for u in plan.units if u.action != "keep"}
    if not active:
        return handles
    for fqn in active:
        unit = model.get_submodule(fqn)
        handles.append(unit.register_forward_pre_hook(_refuse_cache(fqn), with_kwargs=True))
    watch = _StateWatch(model, active, checks=STATE_CHECKS)
    handles.append(model.register_forward_pre_hook(watch.before))
    handles.append(model.register_forward_hook(watch.after))
    return handles


def kv_cache_off(model: nn.Module) -> list[Any]:
    """Call every module of ``model`` whose ``config.use_cache`` is on and whose forward takes
    ``use_cache`` with ``use_cache=False`` in training with gradients (logged once per module).

    Used by the runtime and by ``profile_step``, so the profile sees the step the plan runs.
    Returns the hook handles (``.remove()`` each to undo).
    """
    handles = []
    for fqn, module in model.named_modules():
        position = _use_cache_position(module)
        if position is not None:
            hook = _no_cache(fqn, position)
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return handles


# --- the HF key/value cache --------------------------------------------------------------------
def _use_cache_position(module: nn.Module) -> int | None:
    """Position of ``use_cache`` among the forward's arguments when ``config.use_cache`` is on."""
    if not getattr(getattr(module, "config", None), "use_cache", False):
        return None
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return None
    return names.index("use_cache") if "use_cache" in names else None


def _no_cache(fqn: str, position: int) -> Any:
    warned = [False]

    def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        if not (module.training and torch.is_grad_enabled()) or kwargs.get("use_cache") is False:
            return None
        if len(args) > position:  # passed positionally: left to the unit-level refusal
            return None
        if not warned[0] and not torch.compiler.is_compiling():  # no logging in traced code
            warned[0] = True
            logger.warning(
                "%s (%s): use_cache=True is incompatible with a memory plan in training (the "
                "key/value cache would be written again by recompute and keeps activations on "
                "the device); calling it with use_cache=False, as HF gradient checkpointing does",
                fqn or "model",
                type(module).__name__,
            )
        return args, {**kwargs, "use_cache": False}

    return hook


def _refuse_cache(fqn: str) -> Any:
    def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if not (module.training and torch.is_grad_enabled()) or torch.compiler.is_compiling():
            return
        if any(is_kv_cache(v) for v in tree_flatten((args, kwargs))[0]):
            raise ConfigError(
                f"plan unit {fqn!r} ({type(module).__name__}) receives a key/value cache in "
                "training: a recompute would append to it twice and it keeps activations on the "
                "device. Call the model with use_cache=False and past_key_values=None in "
                f"training, or give {fqn!r} the action 'keep'"
            )

    return hook


# --- generic state written in forward ----------------------------------------------------------
class _StateWatch:
    """Snapshot of the state of the non-keep units before the model's forward, compared after."""

    def __init__(self, model: nn.Module, active: dict[str, str], *, checks: int) -> None:
        self.model = model
        self.active = active
        self.checks_left = checks
        self.before_state: _Snapshot | None = None

    def _modules(self) -> Iterator[tuple[str, str, nn.Module]]:
        for unit_fqn in self.active:
            unit = self.model.get_submodule(unit_fqn)
            for name, module in unit.named_modules(prefix=unit_fqn):
                yield unit_fqn, name, module

    def _snapshot(self) -> _Snapshot:
        state: _Snapshot = {}
        for _unit, name, module in self._modules():
            norms = isinstance(module, _NormBase) and module.track_running_stats
            for key, value in module._buffers.items():
                if value is not None and not (norms and key in _NORM_BUFFERS):
                    state[(name, key)] = (id(value), value._version, None)
            for key, value in module.__dict__.items():
                if key.startswith("_") or key in _IGNORED or isinstance(value, nn.Module):
                    continue
                if isinstance(value, torch.Tensor):
                    state[(name, key)] = (id(value), value._version, None)
                elif isinstance(value, (bool, int, float, str, type(None))):
                    state[(name, key)] = (0, 0, value)  # compared by value
                else:
                    state[(name, key)] = (id(value), 0, None)
        return state

    def before(self, module: nn.Module, args: Any) -> None:
        # NOTE: the checks read ids and version counters, which dynamo cannot trace: a
        # compiled model is checked by its eager forwards only
        if torch.compiler.is_compiling():
            return
        if self.checks_left > 0 and _training(module):
            self.checks_left -= 1
            self.before_state = self._snapshot()

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.before_state is None or torch.compiler.is_compiling():
            return
        before, self.before_state = self.before_state, None
        after = self._snapshot()
        for key in sorted(set(before) | set(after)):
            if before.get(key) != after.get(key):
                name, attribute = key
                unit = next(u for u in self.active if name == u or name.startswith(u + "."))
                raise ConfigError(
                    f"module {name!r} writes {attribute!r} in its forward, inside plan unit "
                    f"{unit!r} ({self.active[unit]}): a recompute would write it twice and an "
                    "offload cannot free what it keeps. Make the forward pure (return the value "
                    f"instead of storing it) or give {unit!r} the action 'keep'"
                )


def _training(module: nn.Module) -> bool:
    return module.training and torch.is_grad_enabled()
