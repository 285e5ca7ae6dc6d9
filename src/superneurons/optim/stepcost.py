"""This device's compute per step for ``auto`` with Adam(W): what a link statement leaves open.

A stated link (``auto:link=RATE,latency=T``) fixes the network; how long one backward and
each optimizer's local ``step()`` take is this device's own, so :func:`measure_compute` times
them (on rank 0, in a one-rank group: nothing is sent), or a caller states them
(:class:`ComputeTimes`, e.g. from an earlier decision's record). 1-bit Adam's codec work (its
per-parameter error feedback, encode and decode, Python loops that per-byte codec costs missed)
is inside its measured steps. Each time is the median of ``repeats`` calls after a first one
(allocation): a busy machine still inflates them, which is why a decision that must not depend
on load takes them stated.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from superneurons.codecs.cast import Fp16Codec
from superneurons.codecs.sign import SignSGDCodec
from superneurons.errors import ConfigError

__all__ = ["ComputeTimes", "OptimizerTimes", "measure_compute"]


@dataclass(frozen=True)
class OptimizerTimes:
    """Measured local seconds of one ``step()``: AdamW, 1-bit Adam in its warm-up (fp16
    encode/decode) and after it (error feedback, sign encode, decode); collectives excluded."""

    adamw_s: float
    warmup_s: float
    compressed_s: float


@dataclass(frozen=True)
class ComputeTimes:
    """This device's compute per step, the input a link statement does not cover: one
    backward of the model and each optimizer's local ``step()`` (:class:`OptimizerTimes`)."""

    backward_s: float
    optimizer: OptimizerTimes

    def __post_init__(self) -> None:
        times = {"backward_s": self.backward_s, **asdict(self.optimizer)}
        for name, value in times.items():
            if not isinstance(value, int | float) or not 0.0 <= value < math.inf:
                raise ConfigError(
                    f"ComputeTimes.{name} must be a finite number >= 0, got {value!r}"
                )


def _optimizer_times(
    params: Sequence[torch.Tensor], world: int, solo: Any, repeats: int
) -> OptimizerTimes:
    """Time each optimizer on copies of ``params`` (with their gradients) on a one-rank group,
    so nothing is sent; 1-bit Adam decodes one payload instead of ``world`` (its decode of
    the others is added from a second decode of the same payloads, ``world - 1`` times). Each
    is the median of ``repeats`` steps after a first one (state allocation)."""
    from superneurons.optim.adam import CompressedAdamW
    from superneurons.strategy.timing import time_call_s

    device = params[0].device

    def copies() -> list[torch.Tensor]:
        out = []
        for p in params:
            q = p.detach().clone().requires_grad_(True)
            q.grad = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            out.append(q)
        return out

    adamw = torch.optim.AdamW(copies(), lr=1e-3)
    dense = [time_call_s(adamw.step, device) for _ in range(repeats + 1)][1:]
    one_bit = CompressedAdamW(
        copies(),
        codec=SignSGDCodec(),
        warmup_steps=repeats + 1,
        warmup_codec=Fp16Codec(),
        process_group=solo,
    )
    times = [time_call_s(one_bit.step, device) for _ in range(2 * repeats + 2)]
    warm, after = times[1 : repeats + 1], times[repeats + 2 :]  # each after a first step
    decode_s = 0.0
    if world > 1:  # the receiver decodes every rank's payload
        flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]).float()
        codec = SignSGDCodec()
        payload = codec.encode(flat)
        decode_s = time_call_s(lambda: codec.decode(payload), device) * (world - 1)
    return OptimizerTimes(
        statistics.median(dense), statistics.median(warm), statistics.median(after) + decode_s
    )


def _backward_s(model: nn.Module, batch: tuple[Any, Any], loss_fn: Any, repeats: int) -> float:
    """Median seconds of one backward of ``model`` on ``batch`` (forward not counted)."""
    from superneurons.strategy.timing import time_call_s

    inputs, targets = batch
    device = next(model.parameters()).device
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up (allocation)
        loss = loss_fn(model(inputs), targets)
        times.append(time_call_s(loss.backward, device))
    return statistics.median(times[1:])


def measure_compute(
    model: nn.Module,
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    world_size: int,
    solo: Any,
    repeats: int = 3,
) -> ComputeTimes:
    """Time one backward of ``model`` on ``batch`` and each optimizer's ``step()`` on its
    gradients (in ``solo``, a one-rank group: nothing is sent). Leaves no trace: the
    gradients are cleared and the RNG streams restored."""
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        backward_s = _backward_s(model, batch, loss_fn, repeats)
        optimizer = _optimizer_times(params, world_size, solo, repeats)
    for p in params:
        p.grad = None
    return ComputeTimes(backward_s, optimizer)
