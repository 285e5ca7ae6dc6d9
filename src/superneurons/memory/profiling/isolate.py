"""Run the user's own model for one profiled step without touching its training state.

:func:`isolated` is how :func:`~superneurons.memory.profiling.step.profile_step` runs a step: on the
user's **real module tree** (so whatever the trainer runs also runs here: instance-level
``forward`` overrides such as TRL's fused LM head or accelerate's autocast wrapper, PEFT
adapters, Liger/Unsloth-style patches, forward hooks), with the tensors a step writes swapped
for clones while the step runs:

* every parameter that requires grad, and every buffer, is replaced in its module by a clone
  (a fake clone under ``FakeTensorMode``, where frozen parameters and plain tensor attributes
  are fake clones too); backward fills the clones' ``.grad``, BatchNorm updates the clones'
  running statistics. Tied parameters stay tied (one clone per original tensor);
* the optimizer stepped is a *shadow* of the innermost torch optimizer (accelerate's
  ``AcceleratedOptimizer`` and Lightning's wrapper are unwrapped, even when they subclass
  ``Optimizer``): same class, same ``param_groups`` hyper-parameters (``foreach``/``fused``
  included), its state cloned onto the clones, none of its instance-level patches (an LR
  scheduler's ``step`` wrapper holds a reference to the *original* optimizer) and none of its
  hooks;
* ``DistributedDataParallel`` (``.module``) and ``torch.compile`` (``_orig_mod``) wrappers are
  taken off: DDP's forward (a collective, and the reducer's hooks) never runs;
* the CPU and CUDA random-number states are forked: dropout masks and data order of training
  are the same as without the profile.

Guarantee: when the block exits, the user's parameters, gradients, buffers, optimizer (state,
hyper-parameters, hooks), LR scheduler, module attributes and RNG states are exactly as they
were. It holds by construction for everything the step reaches through the module tree and the
optimizer; a step that reaches an original tensor some other way (a closure over a parameter,
tensors kept outside ``named_parameters()``) is caught on exit by the tensors' version counters
and gradient identities: gradients it created are removed again, an in-place change of an
original raises :class:`IsolationError` (nothing is ever left changed silently).

A ``fully_shard``-ed (FSDP2) model is isolated by a snapshot of its local shards instead
(:func:`superneurons.memory.fsdp.sharded_isolated`): FSDP2 re-registers its parameters around
every forward, so swapped clones would not be the tensors the step runs on.

Cost: a real run holds a second copy of the trainable parameters, buffers and optimizer state
(frozen parameters are shared); use ``fake=True`` profiles for large models.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory.offload.handover import inner_optimizer

__all__ = ["IsolationError", "isolated", "shadow_optimizer", "unwrapped"]


class IsolationError(RuntimeError):
    """The profiled step changed one of the user's own tensors in place (not through the module
    tree or the optimizer, which are isolated by construction)."""


def unwrapped(model: nn.Module) -> nn.Module:
    """``model`` without ``DistributedDataParallel`` (``.module``) and ``torch.compile``
    (``_orig_mod``) wrappers, in any nesting."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod  # type: ignore[assignment]
        else:
            return model


@dataclass
class _Original:
    """One original tensor: what must be the same when the block exits."""

    name: str
    tensor: torch.Tensor
    version: int
    grad: torch.Tensor | None
    grad_version: int


def _snapshot(named: list[tuple[str, torch.Tensor]]) -> list[_Original]:
    rows, seen = [], set()
    for name, tensor in named:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        grad = tensor.grad
        rows.append(
            _Original(name, tensor, tensor._version, grad, -1 if grad is None else grad._version)
        )
    return rows


def _check_and_restore(originals: list[_Original]) -> None:
    """Gradients the step attached to an original are detached again; in-place changes raise."""
    changed = []
    for row in originals:
        tensor = row.tensor
        if tensor.grad is not row.grad:
            tensor.grad = row.grad  # the step created or replaced it: put back what was there
        elif row.grad is not None and row.grad._version != row.grad_version:
            changed.append(f"{row.name}.grad")
        if tensor._version != row.version:
            changed.append(row.name)
    if changed:
        raise IsolationError(
            f"the profiled step changed the model's own tensors in place ({', '.join(changed[:5])}"
            f"{', ...' if len(changed) > 5 else ''}): they are reached outside the module tree "
            "(e.g. a closure or a list holding the original parameters); training from here "
            "would not be the training you configured: rebuild the model, and report the model "
            "class to superneurons"
        )


def _named_originals(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[Any]:
    named: list[tuple[str, torch.Tensor]] = []
    for fqn, module in model.named_modules(remove_duplicate=False):
        prefix = f"{fqn}." if fqn else ""
        named += [(prefix + k, v) for k, v in module._parameters.items() if v is not None]
        named += [(prefix + k, v) for k, v in module._buffers.items() if v is not None]
    if optimizer is not None:
        for index, (param, state) in enumerate(optimizer.state.items()):
            named += [
                (f"optimizer.state[{index}].{k}", v)
                for k, v in state.items()
                if isinstance(v, torch.Tensor)
            ]
            named.append((f"optimizer.param[{index}]", param))
    return named


def shadow_optimizer(
    optimizer: torch.optim.Optimizer, memo: dict[int, Any]
) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` that steps the clones ``memo`` maps its parameters to.

    ``Optimizer.__getstate__`` (``defaults``, ``state``, ``param_groups``) is deep-copied with
    ``memo``, so param groups and state keys are the clones and the state tensors are copies;
    ``__setstate__`` gives the copy fresh hook dicts and the class's own ``step``. Attributes a
    subclass keeps besides those are deep-copied too, except instance-level overrides of the
    class's methods (an LR scheduler's ``step`` wrapper, accelerate's patched ``step``).
    """
    shadow = copy.deepcopy(optimizer, memo)
    own = vars(shadow)
    for key, value in vars(optimizer).items():
        if key in own or hasattr(type(optimizer), key) or key.startswith("_optimizer_"):
            continue  # the class's own attribute (overridden on the instance) or a hook dict
        own[key] = copy.deepcopy(value, memo)
    for key in list(own):
        if key in ("step", "zero_grad"):
            del own[key]  # a __getstate__ that keeps the instance dict: drop the patches
        elif key.startswith("_optimizer_") and key.endswith("_hooks"):
            own[key] = OrderedDict()  # no user hooks: they may hold the original
    return shadow


@contextlib.contextmanager
def isolated(
    model: nn.Module,
    optimizer: Any = None,
    *,
    fake_mode: Any = None,
) -> Iterator[tuple[nn.Module, torch.optim.Optimizer | None]]:
    """Yield ``(module, optimizer)`` to run one training step on without side effects.

    ``module`` is ``model`` itself, unwrapped (DDP, ``torch.compile``), its trainable
    parameters and buffers swapped for clones until the block exits; ``optimizer`` is a shadow
    of the innermost torch optimizer stepping those clones (None without one). With
    ``fake_mode`` (a ``FakeTensorMode``) the clones are fake and so is every tensor attribute
    of the modules. See the module docstring for the guarantee.

    A model whose parameters are fake already is the caller's own scratch copy (e.g.
    ``simulate_plan``'s): it is yielded as it is, with its gradients reset to None, and with
    the optimizer given (which may be any object with ``step()`` and ``state``).

    Raises:
        ConfigError: ``optimizer`` is not a torch optimizer (nor wraps one).
        IsolationError: on exit, when the step changed an original tensor in place.
    """
    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensor

    root = unwrapped(model)
    if isinstance(next(iter(root.parameters()), None), FakeTensor):
        for fake_param in root.parameters():
            fake_param.grad = None
        yield root, optimizer
        return
    inner = inner_optimizer(optimizer)
    fake = fake_mode is not None
    from superneurons.memory.fsdp import is_fully_sharded, sharded_isolated

    if is_fully_sharded(root):  # FSDP2 re-registers its own parameters: snapshot instead
        if fake:
            raise ConfigError(
                "a fully_shard (FSDP2) model is profiled with real tensors: pass fake=False"
            )
        itself: dict[int, Any] = {id(p): p for p in root.parameters()}  # steps the real ones
        shadow = None if inner is None else shadow_optimizer(inner, itself)
        with sharded_isolated(root, shadow) as pair:
            yield pair
        return
    copying = FakeCopyMode(fake_mode) if fake else contextlib.nullcontext()
    memo: dict[int, Any] = {}
    frozen: dict[int, torch.Tensor] = {}  # frozen parameters left in place (real runs)

    def clone(tensor: torch.Tensor) -> torch.Tensor:
        with copying:
            return copy.deepcopy(tensor, memo)  # type: ignore[no-any-return]

    modules = list(root.modules())
    saved = [(m, dict(vars(m)), dict(m._parameters), dict(m._buffers)) for m in modules]
    originals = _snapshot(_named_originals(root, inner))
    devices = sorted(
        {t.tensor.device for t in originals if t.tensor.device.type == "cuda"}, key=str
    )
    try:
        with torch.random.fork_rng(devices=devices):
            for module in modules:
                for name, param in module._parameters.items():
                    if param is not None and (fake or param.requires_grad):
                        module._parameters[name] = clone(param)  # type: ignore[assignment]
                    elif param is not None:
                        memo[id(param)] = frozen[id(param)] = param  # shared, never stepped
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[name] = clone(buffer)
                if fake:  # plain tensor attributes must be fake too under FakeTensorMode
                    for key, value in list(vars(module).items()):
                        if isinstance(value, torch.Tensor):
                            vars(module)[key] = clone(value)
            shadow = None if inner is None else _shadow(inner, memo, copying, frozen)
            yield root, shadow
    finally:
        for module, attributes, params, buffers in saved:
            vars(module).clear()
            vars(module).update(attributes)
            module._parameters.clear()
            module._parameters.update(params)
            module._buffers.clear()
            module._buffers.update(buffers)
        _check_and_restore(originals)


def _shadow(
    optimizer: torch.optim.Optimizer,
    memo: dict[int, Any],
    copying: Any,
    frozen: dict[int, torch.Tensor],
) -> torch.optim.Optimizer:
    """The shadow, without the frozen originals it would share (a stale ``.grad`` on one would
    otherwise be stepped into the user's tensor)."""
    with copying:
        shadow = shadow_optimizer(optimizer, memo)
    for group in shadow.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in frozen]
    for key in [k for k in shadow.state if id(k) in frozen]:
        del shadow.state[key]
    return shadow
