"""How an outer gradient travels: averaging named flat tensors across ranks, with state.

A *transport* has one method that matters, ``average(flat, state)``: it replaces each named
flat float32 tensor of ``flat`` by its average over the process group, in place, the same on
every rank, and returns the bytes this rank put on the wire (the inputs of its collectives,
as the gradient hook and ``CompressedAdamW`` count them). What it keeps between calls (error
feedback residuals, a round counter for stochastic rounding) lives in the ``state`` it made
with ``new_state()``, which has ``state_dict()``/``load_state_dict()``.

* :class:`Fp32AllReduce`: one fp32 all-reduce, lossless up to the order of the sum;
* :class:`CodecAverage`: each tensor encoded on its own by a codec of the grammar, the
  payloads concatenated into ONE collective: an all-reduce when the codec is summable
  (``fp16``, ``bf16``), else an all-gather and ``decode_sum`` (``qsgd``, ``ctopk``, ``fft``
  ...); with error feedback (Seide et al. 2014; Karimireddy et al., ICML 2019) each rank keeps
  what its codec dropped, by tensor name, and sends it with the next round;
* :class:`TwoPhaseAverage`: the two-phase compressed all-reduce
  (:func:`superneurons.ddp.twophase.average_`: per-chunk-scaled codes in one all-to-all, each
  slice's owner averages and re-quantises, one all-gather), bytes per rank independent of the
  world size, error feedback at the worker and at the slice's owner.

Every rank decodes the same payloads in the same order, so the average is bitwise the same on
every rank whatever the codec loses.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from superneurons.codecs.codec import Codec, Payload
from superneurons.codecs.feedback import feedback_step
from superneurons.codecs.twophase import TwoPhase
from superneurons.compat import all_gather_into_tensor
from superneurons.ddp.twophase import TwoPhaseState, average_
from superneurons.errors import ConfigError
from superneurons.schemes.diloco import DiLoCo, wire_of

__all__ = [
    "CodecAverage",
    "Fp32AllReduce",
    "Transport",
    "TwoPhaseAverage",
    "TwoPhaseWireState",
    "WireState",
    "transport_for",
]

Named = Sequence[tuple[str, torch.Tensor]]
_STATE_VERSION = 1


class Transport(Protocol):
    """Averages named flat float32 tensors across a process group, in place."""

    @property
    def spec(self) -> str:
        """What travels (``fp32``, a codec spec)."""
        ...

    def new_state(self) -> Any:
        """A fresh state (``state_dict()``/``load_state_dict()``) for :meth:`average`."""
        ...

    def average(self, flat: Named, state: Any) -> int:
        """Average every ``(name, tensor)`` of ``flat`` in place; collective; returns the bytes
        this rank sent. ``flat`` must name the same tensors in the same order on every rank."""
        ...


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _check(flat: Named) -> None:
    for name, tensor in flat:
        if tensor.dtype != torch.float32 or tensor.dim() != 1 or not tensor.is_contiguous():
            raise ConfigError(f"outer gradient {name!r} must be a flat contiguous float32 tensor")


@dataclass
class WireState:
    """A transport's state: the rounds so far and, with error feedback, each rank's residual by
    tensor name (what its codec has not delivered yet)."""

    rounds: int = 0
    residuals: dict[str, torch.Tensor] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "rounds": self.rounds,
            "residuals": {k: v.detach().to("cpu", copy=True) for k, v in self.residuals.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ConfigError(
                f"outer-gradient wire state version {state.get('version')!r} is not supported "
                f"(expected {_STATE_VERSION}); start without --resume"
            )
        self.rounds = int(state["rounds"])
        self.residuals = {str(k): v.clone() for k, v in state["residuals"].items()}


@dataclass(frozen=True)
class Fp32AllReduce:
    """The outer gradient in fp32: one all-reduce (sum), divided by the world size."""

    group: dist.ProcessGroup | None = None

    @property
    def spec(self) -> str:
        return "fp32"

    def new_state(self) -> WireState:
        return WireState()

    def average(self, flat: Named, state: WireState) -> int:
        _check(flat)
        world, _ = _world(self.group)
        state.rounds += 1
        if not flat:
            return 0
        message = torch.cat([t for _, t in flat])  # one collective per round
        if world > 1:
            dist.all_reduce(message, group=self.group)
        message /= world
        for (_, tensor), part in zip(
            flat, message.split([t.numel() for _, t in flat]), strict=True
        ):
            tensor.copy_(part)
        return 4 * message.numel()


@dataclass(frozen=True)
class CodecAverage:
    """The outer gradient through ``codec`` (each tensor on its own, one collective), with
    error feedback when ``error_feedback``; stochastic codecs draw from ``(seed, rank, round,
    name)``."""

    codec: Codec
    error_feedback: bool = True
    group: dist.ProcessGroup | None = None
    seed: int = 0

    @property
    def spec(self) -> str:
        return f"ef({self.codec.spec})" if self.error_feedback else str(self.codec.spec)

    def new_state(self) -> WireState:
        return WireState()

    def _generator(self, rank: int, rounds: int, name: str, device: torch.device) -> Any:
        key = f"{self.seed}/{rank}/{rounds}/{name}".encode()
        return torch.Generator(device=device).manual_seed(zlib.crc32(key))

    def average(self, flat: Named, state: WireState) -> int:
        _check(flat)
        world, rank = _world(self.group)
        state.rounds += 1
        payloads: list[Payload] = []
        for name, tensor in flat:
            generator = self._generator(rank, state.rounds, name, tensor.device)
            if self.error_feedback:
                payload, state.residuals[name] = feedback_step(
                    self.codec, tensor, state.residuals.get(name), generator=generator
                )
            else:
                payload = self.codec.encode(tensor, generator=generator)
            payloads.append(payload)
        if not payloads:
            return 0
        sizes = [p.data.numel() for p in payloads]
        message = torch.cat([p.data for p in payloads])
        sent = message.numel() * message.element_size()
        # NOTE: parts are cloned before decoding: an odd byte offset cannot be viewed as fp32.
        if self.codec.summable:
            if world > 1:
                dist.all_reduce(message, group=self.group)
            parts = message.split(sizes)
            sums = [
                self.codec.decode(Payload(part.clone(), t.numel()))
                for part, (_, t) in zip(parts, flat, strict=True)
            ]
        else:
            gathered = message
            if world > 1:
                gathered = message.new_empty(world * message.numel())
                all_gather_into_tensor(gathered, message, group=self.group)
            per_rank = [chunk.split(sizes) for chunk in gathered.chunk(world)]
            sums = [
                self.codec.decode_sum([Payload(parts[i].clone(), t.numel()) for parts in per_rank])
                for i, (_, t) in enumerate(flat)
            ]
        for (_, tensor), total in zip(flat, sums, strict=True):
            tensor.copy_(total.reshape(-1)).div_(world)
        return sent


@dataclass
class TwoPhaseWireState:
    """:class:`TwoPhaseAverage`'s state: the rounds so far and the two-phase residuals (worker
    and owner, by tensor name; they load only into a group of the same size)."""

    rounds: int = 0
    twophase: TwoPhaseState = field(default_factory=TwoPhaseState)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "rounds": self.rounds,
            "twophase": self.twophase.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION or "twophase" not in state:
            raise ConfigError(
                "this outer-gradient wire state is not a two-phase one (or not version "
                f"{_STATE_VERSION}); resume with the --sync spec it was saved with"
            )
        self.rounds = int(state["rounds"])
        self.twophase.load_state_dict(state["twophase"])


@dataclass(frozen=True)
class TwoPhaseAverage:
    """The outer gradient through the two-phase compressed all-reduce ``config``, with error
    feedback at the worker and at each slice's owner when ``error_feedback``; stochastic
    rounding draws from ``(seed, rank, round, name)``."""

    config: TwoPhase
    error_feedback: bool = True
    group: dist.ProcessGroup | None = None
    seed: int = 0

    @property
    def spec(self) -> str:
        return f"ef({self.config.spec})" if self.error_feedback else str(self.config.spec)

    def new_state(self) -> TwoPhaseWireState:
        return TwoPhaseWireState(twophase=TwoPhaseState(seed=self.seed))

    def average(self, flat: Named, state: TwoPhaseWireState) -> int:
        _check(flat)
        world, rank = _world(self.group)
        state.rounds += 1
        if not flat or world == 1:  # nothing to average with: the outer gradient as it is
            return 0
        rounds = state.rounds

        def generators(key: str) -> torch.Generator:
            seed = zlib.crc32(f"{self.seed}/{rank}/{rounds}/{key}".encode())
            return torch.Generator(device=flat[0][1].device).manual_seed(seed)

        tensors = [(name, tensor, self.config) for name, tensor in flat]
        return average_(
            tensors,
            state.twophase,
            group=self.group,
            error_feedback=self.error_feedback,
            generators=generators,
        )


def transport_for(
    config: DiLoCo, *, group: dist.ProcessGroup | None = None, seed: int = 0
) -> Transport:
    """The transport ``config``'s wire names: fp32, a codec or the two-phase all-reduce
    (``ef(...)``: error feedback)."""
    codec, feedback = wire_of(config.inner)
    if codec is None:
        return Fp32AllReduce(group)
    if isinstance(codec, TwoPhase):
        return TwoPhaseAverage(codec, error_feedback=feedback, group=group, seed=seed)
    return CodecAverage(codec, error_feedback=feedback, group=group, seed=seed)
