"""The mutable state of a compressed DDP comm hook, checkpointable by parameter name.

Everything that changes during training lives here and round-trips through
``state_dict()``/``load_state_dict()``: the step counter, error-feedback residuals keyed by
parameter name (DDP rebuilds its buckets after the first step, so bucket indices are not
stable), PowerSGD's warm-start factors, the two-phase routes' worker and owner residuals, the RNG of stochastic codecs, ``auto``'s decision and
the byte counters. The process group is never part of the state dict, and the state dict holds
tensors and plain data only, so a weights-only ``torch.load`` reads it back.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from superneurons.ddp.powersgd import PowerSGDState
from superneurons.ddp.twophase_state import TwoPhaseState
from superneurons.errors import ConfigError
from superneurons.schemes.compose import Base, Compression, Pipeline

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
        PowerSGDState as TorchPowerSGDState,
    )

    from superneurons.ddp.autorun import AutoController
    from superneurons.ddp.bucket import Piece

__all__ = ["CompressionState", "WireBuffers"]

_STATE_VERSION = 2


@dataclass
class WireBuffers:
    """Pre-allocated send and receive buffers of one bucket's all-gather (reused every step)."""

    send: torch.Tensor  # (message bytes,) uint8
    received: torch.Tensor  # (world_size * message bytes,) uint8


@dataclass
class CompressionState:
    """What a registered hook knows and remembers.

    ``step`` counts finished backward passes (= optimizer steps: the hook is not called under
    ``no_sync``). ``bytes_sent_step`` is the payload this rank put on the wire during the last
    finished step (the message it contributes to each collective, summed over buckets);
    ``dense_bytes_step`` is what plain fp32 all-reduce would have contributed, so
    ``dense_bytes_step / bytes_sent_step`` is the compression ratio.
    """

    compression: Compression
    pipeline: Pipeline
    process_group: dist.ProcessGroup | None
    world_size: int
    rank: int
    names_by_param: dict[int, str]
    seed: int = 0
    embedding_names: frozenset[str] = frozenset()  # row-sparse candidates (nn.Embedding weights)
    step: int = 0
    residuals: dict[str, torch.Tensor] = field(default_factory=dict)
    powersgd: PowerSGDState | None = None
    twophase: TwoPhaseState | None = None  # residuals of the two-phase routes, by name
    torch_state: TorchPowerSGDState | None = None
    auto: AutoController | None = None
    bytes_sent_step: int = 0
    dense_bytes_step: int = 0
    bytes_sent_total: int = 0
    last_theta: float | None = None
    wires: dict[tuple[str, ...], WireBuffers] = field(default_factory=dict)
    # cast routes' kept buffers (x / P, the wire, two residual slabs), by bucket signature
    scratch: dict[tuple[str, ...], torch.Tensor] = field(default_factory=dict)
    # two-phase exchanges whose second phase waits for the next bucket's hook (not state)
    deferred: list[Any] = field(default_factory=list)
    _bytes_current: int = 0
    _dense_current: int = 0

    @property
    def codec(self) -> Base:
        """The base reduction inside the wrappers (a codec, PowerSGD, an anchor or Auto)."""
        return self.pipeline.base

    @property
    def spec(self) -> str:
        """The canonical spec string of the composed compression."""
        return self.compression.spec

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
        mixed = (self.seed * 1_000_003 + self.rank) * 1_000_033 + self.step
        return torch.Generator().manual_seed(
            (mixed * 2_654_435_761 + zlib.crc32(name.encode())) % 2**63
        )

    def kept(
        self, key: tuple[str, ...], numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A flat buffer kept in :attr:`scratch` under ``key`` (re-made when its size changes):
        the routes' per-step buffers, so a step allocates nothing gradient-sized."""
        kept = self.scratch.get(key)
        if kept is None or kept.numel() != numel or kept.dtype != dtype or kept.device != device:
            kept = self.scratch[key] = torch.empty(numel, dtype=dtype, device=device)
        return kept

    def spare_slab(
        self, key: tuple[str, ...], pieces: Sequence[Piece], numel: int, device: torch.device
    ) -> torch.Tensor:
        """Of two float32 residual slabs kept for ``key``, the one the current residuals of
        ``pieces`` do not live in (they are views of the other one, or of neither after a
        resume): a step writes its new residuals there and keeps the old ones when it is not
        finite."""
        current = self.residuals.get(pieces[0].name)
        held = current.untyped_storage().data_ptr() if current is not None else None
        for slot in ("ef0", "ef1"):
            slab = self.kept((slot, *key), numel, torch.float32, device)
            if slab.untyped_storage().data_ptr() != held:
                return slab
        raise AssertionError("two distinct slabs cannot both hold the residual")

    def summary(self) -> dict[str, Any]:
        """For ``summary.json``: the composed spec and ``auto``'s decision (None otherwise)."""
        assignment = self.auto.assignment if self.auto is not None else None
        return {
            "compression": self.spec,
            "sync_assignment": assignment.to_dict() if assignment is not None else None,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything mutable (tensors cloned); never the process group."""
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "spec": self.spec,
            "step": self.step,
            "residuals": {name: r.detach().clone() for name, r in self.residuals.items()},
            "bytes_sent_total": self.bytes_sent_total,
            "last_theta": self.last_theta,
        }
        if self.powersgd is not None:
            state["powersgd"] = self.powersgd.state_dict()
        if self.twophase is not None:
            state["twophase"] = self.twophase.state_dict()
        if self.torch_state is not None:
            state["torch_powersgd"] = _torch_powersgd_state(self.torch_state)
        if self.auto is not None:
            state["auto"] = self.auto.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the compression spec must match."""
        if state.get("version") != _STATE_VERSION:
            raise ConfigError(
                f"compression state version {state.get('version')!r} is not supported "
                f"(expected {_STATE_VERSION}); start without --resume"
            )
        if state["spec"] != self.spec:
            raise ConfigError(
                f"checkpoint was written with compression {state['spec']!r} but this run uses "
                f"{self.spec!r}; resume with the same --compress and flags"
            )
        self.step = int(state["step"])
        self.residuals = {name: r.clone() for name, r in state["residuals"].items()}
        self.bytes_sent_total = int(state["bytes_sent_total"])
        self.last_theta = state["last_theta"]
        if "powersgd" in state:  # auto creates PowerSGD's state on first use: create it here
            if self.powersgd is None:
                self.powersgd = PowerSGDState(seed=self.seed)
            self.powersgd.load_state_dict(state["powersgd"])
        if "twophase" in state:  # created on first use too
            if self.twophase is None:
                self.twophase = TwoPhaseState(seed=self.seed, world_size=self.world_size)
            self.twophase.load_state_dict(state["twophase"])
        if self.torch_state is not None:
            _load_torch_powersgd_state(self.torch_state, state["torch_powersgd"])
        if self.auto is not None:
            self.auto.load_state_dict(state["auto"])


def _cloned(value: Any) -> Any:
    """``value``, or a copy of it with cloned tensors when it is a dict of them."""
    if not isinstance(value, dict):  # error_dict, p_memory_dict, q_memory_dict: tensors
        return value
    return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in value.items()}


def _torch_powersgd_state(torch_state: Any) -> dict[str, Any]:
    """PyTorch's ``PowerSGDState`` as tensors and plain data, which a weights-only
    ``torch.load`` reads back: its slots but the process group (tensors cloned), and its numpy
    ``RandomState`` (what ``__getstate__`` would pickle as an object) as its MT19937 key and
    position (:func:`_load_torch_powersgd_state` restores it bit for bit)."""
    slots = [slot for slot in type(torch_state).__slots__ if slot != "process_group"]
    state = {slot: _cloned(getattr(torch_state, slot)) for slot in slots}
    kind, keys, position, has_gauss, gauss = torch_state.rng.get_state()
    state["rng"] = {
        "kind": str(kind),
        "keys": torch.from_numpy(keys.astype("int64")),  # (624,) uint32 values
        "position": int(position),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }
    return state


def _load_torch_powersgd_state(torch_state: Any, state: dict[str, Any]) -> None:
    """Restore :func:`_torch_powersgd_state` output into ``torch_state`` (its process group
    is left as it is)."""
    import numpy as np

    for slot, value in state.items():
        if slot == "rng" and isinstance(value, dict):
            keys = value["keys"].numpy().astype(np.uint32)
            rng = np.random.RandomState()
            rng.set_state(
                (value["kind"], keys, value["position"], value["has_gauss"], value["gauss"])
            )
            value = rng
        setattr(torch_state, slot, _cloned(value))
