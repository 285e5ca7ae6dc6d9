"""What a recorded step's storages belong to, beyond their category
(``memory.profiling.recording``).

The host optimizer plans per gradient bucket, so a profile names the parameter of each gradient
(in the order of ``Profile.grad_births``) and the event its post-accumulate hook ran at (later
than the gradient's birth when the storage was made earlier: a head computing its gradient in
the forward); the predictor keeps on the device what the tensor pool would never move
(:func:`kept_in_place`, as ``TensorPool`` decides).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from superneurons.memory.profile_types import Profile

__all__ = ["kept_in_place", "with_owners"]


def kept_in_place(tensor: torch.Tensor) -> bool:
    """A save the tensor pool leaves on the device: not strided, or a broadcast view (a stride
    of 0 over a dimension longer than 1)."""
    if tensor.layout != torch.strided:
        return True
    return any(st == 0 for sz, st in zip(tensor.size(), tensor.stride(), strict=True) if sz > 1)


def with_owners(
    profile: Profile,
    rec: Any,
    *,
    grad_names: Mapping[int, str],
    opt_storages: set[int],
    grad_ready: Mapping[str, int],
    param_numel: int,
    frozen_bytes: int = 0,
) -> Profile:
    """``profile`` (built from the recorder ``rec``) with ``grad_params`` (storage serial ->
    parameter fqn in ``grad_names``), ``grad_ready`` (fqn -> hook event), ``param_numel``, ``frozen_bytes``, and
    ``StorageLife.pool_keeps`` of the saves ``rec`` marked ``pool_keeps``."""
    names = tuple(
        grad_names[sid]
        for sid in rec.tracker.nbytes  # the order build_profile takes the gradients in
        if sid in grad_names and sid not in rec.param_storages and sid not in opt_storages
    )
    keeps = {row["sid"] for row in rec.saved if row.get("pool_keeps")}
    order = list(dict.fromkeys(row["sid"] for row in rec.saved))  # the storages' order
    return replace(
        profile,
        grad_params=names,
        grad_ready=tuple(
            grad_ready.get(name, birth)
            for name, (birth, _) in zip(names, profile.grad_births, strict=True)
        ),
        param_numel=param_numel,
        frozen_bytes=frozen_bytes,
        storages=tuple(
            replace(life, pool_keeps=True) if sid in keeps else life
            for sid, life in zip(order, profile.storages, strict=True)
        ),
    )
