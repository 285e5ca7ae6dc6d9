"""A deep causal LM's smallest peaks from shallow copies of it: ``plan --max-* --fit-depth``.

A decoder-only LM is an embedding, ``L`` identical decoder layers and a head. Every strategy's
smallest peak is then affine in ``L`` at a fixed batch and sequence: the resident parameters,
gradients and optimizer state grow by one layer's each, the checkpoints a plan keeps by one
layer's input each, and the working set the peak sits in (one layer's, or the head's) does not
grow at all. So the peaks of the same configuration with :data:`PROBE_LAYERS` decoder layers,
extrapolated on the line through them, stand for the full depth's (this is the depth analogue
of the affine fit :mod:`superneurons.memory.sizing.search` makes over sizes, and of the
``[6, 32, n, 6]`` ResNet family's, SuperNeurons §4). A Llama-3.3-70B step (80 layers) then
costs the fake ops of 12 layers instead of 80. The probes are 4 and 8 layers deep, not 1 and 2:
the peak of an offloading plan sits in the second layer's backward, next to the first layer's
(measured on Llama-3.1-8B with QLoRA at 16k tokens: the per-layer increment is the same from 4
layers on, to the byte at 32, and off by 43% between 2 and 4).

:func:`depth_fit_residual` checks the line at :data:`CHECK_LAYERS` layers against a direct
profile; callers report it, and benchmarks also check the answer at full depth directly.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from superneurons.errors import ConfigError

__all__ = [
    "CHECK_LAYERS",
    "PROBE_LAYERS",
    "depth_fit_residual",
    "extrapolated",
    "num_layers",
    "with_layers",
]

PROBE_LAYERS: tuple[int, int] = (4, 8)  # decoder layers of the two shallow copies profiled
CHECK_LAYERS = 16  # where the line is checked against a direct profile


def num_layers(config: Any) -> int:
    """The configuration's decoder layers (``num_hidden_layers``, GPT-2's ``n_layer``)."""
    value = getattr(config, "num_hidden_layers", None)
    if not isinstance(value, int) or value < 1:
        raise ConfigError("--fit-depth needs a configuration with num_hidden_layers")
    return value


def with_layers(config: Any, layers: int) -> Any:
    """A copy of ``config`` with ``layers`` decoder layers (per-layer lists cut to match)."""
    shallow = copy.deepcopy(config)
    shallow.num_hidden_layers = layers
    kinds = getattr(shallow, "layer_types", None)
    if isinstance(kinds, list):  # e.g. Qwen2's sliding / full attention per layer
        shallow.layer_types = kinds[:layers]
    return shallow


def extrapolated(peaks_at: Callable[[int], dict[str, int]], layers: int) -> dict[str, int]:
    """Each strategy's peak at ``layers`` on the line through ``peaks_at(n)`` for the
    :data:`PROBE_LAYERS` (``peaks_at(layers)`` itself when that is no deeper than the deeper
    probe)."""
    low, high = PROBE_LAYERS
    if layers <= high:
        return peaks_at(layers)
    at_low, at_high = peaks_at(low), peaks_at(high)
    return {
        strategy: round(
            at_high[strategy]
            + (at_high[strategy] - at_low[strategy]) * (layers - high) / (high - low)
        )
        for strategy in at_high
    }


def depth_fit_residual(peaks_at: Callable[[int], dict[str, int]]) -> float:
    """The largest relative error, over strategies, of the line through the
    :data:`PROBE_LAYERS` at :data:`CHECK_LAYERS` layers against a direct profile."""
    line = extrapolated(peaks_at, CHECK_LAYERS)
    direct = peaks_at(CHECK_LAYERS)
    return max(abs(line[s] - direct[s]) / max(direct[s], 1) for s in direct)
