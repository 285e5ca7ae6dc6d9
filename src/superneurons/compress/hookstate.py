"""The mutable state of a compressed DDP comm hook, checkpointable by parameter name.

Everything that changes during training lives here and round-trips through
``state_dict()``/``load_state_dict()``: the step counter, error-feedback residuals keyed by
parameter name (DDP rebuilds its buckets after the first step, so bucket indices are not
stable), PowerSGD's warm-start factors, the RNG of stochastic codecs, θ-schedule state and the
byte counters. The process group is never part of the state dict.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from superneurons.errors import ConfigError

__all__ = ["CompressionState", "HookOptions"]

_STATE_VERSION = 1


@dataclass(frozen=True)
class HookOptions:
    """User options of :func:`~superneurons.compress.hook.register_compression`."""

    spec: str
    error_feedback: bool = True
    warmup_steps: int = 0
    seed: int = 0
    theta_schedule: str = "none"  # repr of the schedule, for the cross-rank config check

    def __post_init__(self) -> None:
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int):
            raise ConfigError(f"warmup_steps must be an integer, got {self.warmup_steps!r}")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")


@dataclass
class CompressionState:
    """What a registered hook knows and remembers.

    ``step`` counts finished backward passes (= optimizer steps: the hook is not called under
    ``no_sync``). ``bytes_sent_step`` is the payload this rank put on the wire during the last
    finished step (the message it contributes to each collective, summed over buckets);
    ``dense_bytes_step`` is what plain fp32 all-reduce would have contributed, so
    ``dense_bytes_step / bytes_sent_step`` is the compression ratio.
    """

    options: HookOptions
    codec: Any  # a Codec, a PowerSGD config or a TorchAnchor
    process_group: dist.ProcessGroup | None
    world_size: int
    rank: int
    names_by_param: dict[int, str]
    theta_schedule: Any = None
    step: int = 0
    residuals: dict[str, torch.Tensor] = field(default_factory=dict)
    powersgd: Any = None  # PowerSGDState when the codec is PowerSGD
    torch_state: Any = None  # torch's PowerSGDState for the torch-powersgd anchor
    bytes_sent_step: int = 0
    dense_bytes_step: int = 0
    bytes_sent_total: int = 0
    last_theta: float | None = None
    _bytes_current: int = 0
    _dense_current: int = 0

    def begin_step(self) -> None:
        """Called by the first bucket of a backward pass."""
        self._bytes_current = 0
        self._dense_current = 0

    def count(self, *, sent_bytes: int, dense_bytes: int) -> None:
        self._bytes_current += sent_bytes
        self._dense_current += dense_bytes

    def end_step(self) -> None:
        """Called by the last bucket of a backward pass: one optimizer step done."""
        self.bytes_sent_step = self._bytes_current
        self.dense_bytes_step = self._dense_current
        self.bytes_sent_total += self._bytes_current
        self.step += 1

    def generator_for(self, name: str) -> torch.Generator:
        """The RNG of stochastic codecs for parameter ``name`` at this step on this rank.

        NOTE: derived from (seed, rank, step, name) rather than drawn from one stream, so the
        random bits do not depend on DDP's bucket layout (which changes after the first step
        and after a resume): a resumed run continues bit for bit.
        """
        mixed = (self.options.seed * 1_000_003 + self.rank) * 1_000_033 + self.step
        return torch.Generator().manual_seed(
            (mixed * 2_654_435_761 + zlib.crc32(name.encode())) % 2**63
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything mutable (tensors cloned); never the process group."""
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "spec": self.options.spec,
            "step": self.step,
            "residuals": {name: r.detach().clone() for name, r in self.residuals.items()},
            "bytes_sent_total": self.bytes_sent_total,
            "last_theta": self.last_theta,
        }
        if self.powersgd is not None:
            state["powersgd"] = self.powersgd.state_dict()
        if self.torch_state is not None:
            state["torch_powersgd"] = self.torch_state.__getstate__()
        if self.theta_schedule is not None and hasattr(self.theta_schedule, "state_dict"):
            state["theta_schedule"] = self.theta_schedule.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the codec spec must match."""
        if state.get("version") != _STATE_VERSION:
            raise ConfigError(
                f"compression state version {state.get('version')!r} is not supported "
                f"(expected {_STATE_VERSION}); start without --resume"
            )
        if state["spec"] != self.options.spec:
            raise ConfigError(
                f"checkpoint was written with --compress {state['spec']!r} but this run uses "
                f"{self.options.spec!r}; resume with the same codec"
            )
        self.step = int(state["step"])
        self.residuals = {name: r.clone() for name, r in state["residuals"].items()}
        self.bytes_sent_total = int(state["bytes_sent_total"])
        self.last_theta = state["last_theta"]
        if self.powersgd is not None:
            self.powersgd.load_state_dict(state["powersgd"])
        if self.torch_state is not None:
            self.torch_state.__setstate__(state["torch_powersgd"])
            self.torch_state.process_group = self.process_group
        if "theta_schedule" in state and hasattr(self.theta_schedule, "load_state_dict"):
            self.theta_schedule.load_state_dict(state["theta_schedule"])
