"""The largest-layer bound of a step: resident state plus the largest single-unit working set.

SuperNeurons (Wang et al., PPoPP'18 §3) claims its memory techniques bring the network-wide peak
down to "the maximal memory usage among layers". A plan's floor is therefore reported next to
``resident_bytes + largest_unit_bytes``:

* ``resident_bytes``: parameters, gradients and optimizer state (steady state), which no
  activation plan moves;
* the working set of a unit is, over the events of its forward and of its backward, the live
  activation bytes (saved + temporaries) minus what *other* units saved: the unit's own saved
  tensors (all of them, as a recompute re-creates them), its input, the gradients flowing through
  it and its transient buffers. The loss (the ops after the model's forward, and its backward
  before the first unit's) is a pseudo-unit :data:`LOSS`: it is part of every training step and
  no keep/offload/recompute action removes it.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from superneurons.memory.profile_types import CATEGORIES, Profile, layer_units

__all__ = [
    "LOSS",
    "head_loss_bytes",
    "largest_unit_bytes",
    "resident_bytes",
    "split_largest",
    "working_sets",
]

LOSS = "<loss>"


def resident_bytes(profile: Profile, *, host_optimizer: bool = False) -> int:
    """Parameters + gradients + optimizer state of the step; with ``host_optimizer`` (state on
    the host, gradients leaving bucket by bucket) the parameters alone."""
    if host_optimizer:
        return profile.param_bytes
    return profile.param_bytes + profile.grad_bytes + profile.optimizer_state_bytes


def working_sets(profile: Profile) -> dict[str, int]:
    """Each unit's (and the loss's) largest forward/backward working set in bytes."""
    table = profile.timeline_array(steady_state=True)
    active = table[CATEGORIES.index("saved")] + table[CATEGORIES.index("temporaries")]
    last = profile.num_events - 1
    change = np.zeros(profile.num_events + 1, dtype=np.int64)
    lives_of: dict[str, list[tuple[int, int, int]]] = {}
    for life in profile.storages:
        owners = [f for f in life.units if f]
        if not owners:
            continue
        change[life.birth] += life.nbytes
        change[min(life.death, last) + 1] -= life.nbytes
        for fqn in owners:
            lives_of.setdefault(fqn, []).append((life.birth, life.death, life.nbytes))
    unit_saved = np.cumsum(change[:-1])  # bytes saved by any unit, live after each event
    sets: dict[str, int] = {}
    for unit in profile.units:
        windows = []
        for call in range(max(len(unit.calls), 1)):  # each forward call, and its backward
            fwd_start, fwd_end, bwd_start, bwd_end = unit.window(call)
            windows += [(fwd_start, fwd_end), (bwd_start, max(bwd_end, bwd_start))]
        best = 0
        for start, end in windows:
            if start < 0 or end < start:
                continue
            own = np.zeros(end - start + 1, dtype=np.int64)
            for birth, death, nbytes in lives_of.get(unit.fqn, ()):
                low, high = max(start, birth), min(end, death)
                if low <= high:
                    own[low - start : high - start + 1] += nbytes
            window = active[start : end + 1] - unit_saved[start : end + 1] + own
            best = max(best, int(window.max(initial=0)))
        sets[unit.fqn] = best
    first_bwd = min(
        (u.bwd_start_event for u in profile.units if u.bwd_start_event >= 0),
        default=profile.backward_end_event + 1,
    )
    start = profile.model_end_event + 1 if profile.model_end_event >= 0 else 0
    end = min(first_bwd - 1, profile.backward_end_event)
    if 0 <= start <= end:
        loss = active[start : end + 1] - unit_saved[start : end + 1]
        sets[LOSS] = int(loss.max(initial=0))
    return sets


def head_loss_bytes(profile: Profile) -> int:
    """The working set of the LM head unit plus the loss's (:func:`working_sets`): what the
    head + loss needs at once, chunked or not; 0 for a model without a head."""
    sets = working_sets(profile)
    return sets.get(profile.head_unit, 0) + sets.get(LOSS, 0) if profile.head_unit else 0


def largest_unit_bytes(profile: Profile) -> int:
    """The largest working set of one unit (or the loss): see :func:`working_sets`."""
    return max(working_sets(profile).values(), default=0)


def split_largest(model: nn.Module, profile: Profile, *, factor: float = 1.5) -> list[str]:
    """Units for a second profile: each unit whose working set exceeds ``factor`` x the median
    unit's is replaced by its layers (:func:`layer_units`), the others kept.

    The floor of a plan is set by the largest working set; splitting only the few units that
    hold it (a ResNet's high-resolution stages) lowers it at a fraction of the planning cost of
    splitting everything (SuperNeurons plans per layer, Wang et al., PPoPP'18 §3).
    """
    sets = working_sets(profile)
    sizes = sorted(sets[u.fqn] for u in profile.units)
    if not sizes:
        return []
    threshold = factor * sizes[len(sizes) // 2]
    layers = layer_units(model)
    units: list[str] = []
    for unit in profile.units:
        inner = [f for f in layers if f.startswith(unit.fqn + ".")]
        units += inner if sets[unit.fqn] > threshold and inner else [unit.fqn]
    return units
