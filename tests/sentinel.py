"""A fingerprint of everything a training run holds, to prove that planning changes none of it.

``fingerprint(model, optimizer, scheduler)`` returns plain data (bytes, numbers, strings): the
parameters, their gradients, the buffers, each module's instance attributes and mode, the
optimizer's state (every tensor's bytes) and hyper-parameters, its instance-level attributes,
the LR scheduler's state and the CPU (and CUDA) random-number states. Equal fingerprints before
and after a call mean the call left the run exactly as it was.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn


def _bytes(tensor: torch.Tensor | None) -> Any:
    if tensor is None:
        return None
    data = tensor.detach().cpu().contiguous().reshape(-1)
    return (str(data.dtype), tuple(tensor.shape), data.view(torch.uint8).numpy().tobytes())


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _bytes(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return type(value).__name__


def _inner(optimizer: Any) -> Any:
    while getattr(optimizer, "optimizer", None) is not None:
        optimizer = optimizer.optimizer
    return optimizer


def fingerprint(model: nn.Module, optimizer: Any = None, scheduler: Any = None) -> dict[str, Any]:
    """Everything a step could change, as comparable plain data."""
    record: dict[str, Any] = {
        "params": {n: _bytes(p) for n, p in model.named_parameters()},
        "grads": {n: _bytes(p.grad) for n, p in model.named_parameters()},
        "grad_ids": [id(p.grad) if p.grad is not None else None for p in model.parameters()],
        "param_ids": [id(p) for p in model.parameters()],
        "buffers": {n: _bytes(b) for n, b in model.named_buffers()},
        "modules": {
            n: (m.training, sorted(vars(m)), sorted(m._forward_hooks), sorted(m._forward_pre_hooks))
            for n, m in model.named_modules()
        },
        "rng": _bytes(torch.get_rng_state()),
        "python_rng": random.getstate(),
    }
    if torch.cuda.is_available():
        record["cuda_rng"] = [_bytes(s) for s in torch.cuda.get_rng_state_all()]
    if optimizer is not None:
        record["wrapper"] = (sorted(vars(optimizer)), repr(vars(optimizer).get("step")))
        inner = _inner(optimizer)
        state = inner.state_dict()
        record["optimizer"] = {
            "state": _plain(state["state"]),
            "groups": _plain(state["param_groups"]),
            "attributes": sorted(vars(inner)),
            "step": repr(vars(inner).get("step")),
            "param_ids": [id(p) for g in inner.param_groups for p in g["params"]],
            "state_ids": [id(p) for p in inner.state],
        }
    if scheduler is not None:
        record["scheduler"] = _plain(scheduler.state_dict())
    return record


def training_state(
    model: nn.Module, optimizer: Any = None, scheduler: Any = None
) -> dict[str, Any]:
    """The fingerprint without the modules' attributes and hooks (which applying a plan
    legitimately adds): parameters, gradients, buffers, optimizer, scheduler, RNG."""
    record = fingerprint(model, optimizer, scheduler)
    record.pop("modules")
    return record


def first_difference(before: Any, after: Any, path: str = "") -> str | None:
    """Where two fingerprints first differ, as a dotted path with both sides (short), or None
    when they are equal. A failure then names what changed instead of printing both records."""
    if isinstance(before, dict) and isinstance(after, dict):
        for key in [*before, *(k for k in after if k not in before)]:
            if key not in before or key not in after:
                return f"{path}{key}: only {'after' if key in after else 'before'}"
            found = first_difference(before[key], after[key], f"{path}{key}.")
            if found is not None:
                return found
        return None
    sequences = isinstance(before, (list, tuple)) and isinstance(after, (list, tuple))
    if sequences and len(before) == len(after):
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            found = first_difference(b, a, f"{path}{i}.")
            if found is not None:
                return found
        return None
    if before == after:
        return None
    return f"{path.rstrip('.')}: {_short(before)} before, {_short(after)} after"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else f"{text[:117]}..."


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    """Equal fingerprints, or an assertion naming the first part that differs."""
    difference = first_difference(before, after)
    assert difference is None, f"changed: {difference}"
