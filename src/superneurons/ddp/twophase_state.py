"""The two-phase all-reduce's error-feedback state: residuals by tensor name, checkpointable.

The worker residual of a tensor lives in the transformed domain of its padded layout, the
owner residual is the one slice this rank owns (see :mod:`superneurons.codecs.twophase`);
both depend on the world size, so a state loads only into a group of the same size.
:meth:`TwoPhaseState.release` turns what they still owe back into one gradient-shaped tensor
for a route that averages by a plain sum (``auto`` moved the parameter).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from superneurons.codecs.coding.orthogonal import inverse_, rademacher
from superneurons.codecs.twophase import TwoPhase
from superneurons.errors import ConfigError

__all__ = ["TwoPhaseState"]

_STATE_VERSION = 1


@dataclass
class TwoPhaseState:
    """Error-feedback residuals of the two-phase all-reduce, by tensor name.

    ``worker[name]``: this rank's residual of the whole (padded) tensor, in the transformed
    domain, ``(P * slice_numel,)``; ``owner[name]``: the residual of the slice this rank owns,
    ``(slice_numel,)``. Both depend on the world size (the layout does), so a state loads
    only into a group of the same size. Buffers and the transform's signs are caches, not
    state.
    """

    seed: int = 0
    world_size: int | None = None
    worker: dict[str, torch.Tensor] = field(default_factory=dict)
    owner: dict[str, torch.Tensor] = field(default_factory=dict)
    # the config each residual was made under (its layout and transform), by name
    configs: dict[str, TwoPhase] = field(default_factory=dict)
    _signs: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict, repr=False)
    _buffers: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict, repr=False)

    def signs(self, name: str, cols: int, device: torch.device) -> torch.Tensor:
        """The transform's seeded ±1 vector for ``name`` (the same on every rank)."""
        key = (name, cols)
        signs = self._signs.get(key)
        if signs is None or signs.device != device:
            signs = self._signs[key] = rademacher(self.seed, name, cols, device)
        return signs

    def buffer(
        self, key: tuple[Any, ...], numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The first ``numel`` elements of a zeroed buffer kept under ``key``, grown (never
        shrunk) to the largest request, so tensors of different sizes share one scratch."""
        kept = self._buffers.get(key)
        if kept is None or kept.numel() < numel or kept.dtype != dtype or kept.device != device:
            kept = self._buffers[key] = torch.zeros(numel, dtype=dtype, device=device)
        return kept[:numel]

    def spare(self, kind: str, name: str, numel: int, device: torch.device) -> torch.Tensor:
        """Of two kept buffers for ``name``'s ``kind`` ("worker" or "owner") residual, the one
        that does not hold it: the next residual is written there and replaces the current
        one only when every value was finite (a non-finite step keeps the old one)."""
        current = (self.worker if kind == "worker" else self.owner).get(name)
        held = current.untyped_storage().data_ptr() if current is not None else None
        for slot in (0, 1):
            spare = self.buffer(("residual", kind, name, slot), numel, torch.float32, device)
            if spare.untyped_storage().data_ptr() != held:
                return spare
        raise AssertionError("two distinct buffers cannot both hold the residual")

    def release(self, name: str, numel: int, rank: int) -> torch.Tensor | None:
        """Remove ``name``'s residuals and return what they still owe as one flat tensor of
        ``numel`` values in the gradient's own domain, for a route that averages by a plain
        sum / P (``auto`` moved the parameter): the worker residual, plus P times the owned
        slice's residual at this rank's slice (the owner's residual is already averaged).
        None when there is nothing."""
        worker, owner = self.worker.pop(name, None), self.owner.pop(name, None)
        config = self.configs.pop(name, None)
        if config is None or (worker is None and owner is None):
            return None
        assert self.world_size is not None
        layout = config.layout(numel, self.world_size)
        device = worker.device if worker is not None else owner.device  # type: ignore[union-attr]
        owed = torch.zeros(layout.padded_numel, dtype=torch.float32, device=device)
        if worker is not None:
            owed += worker
        if owner is not None:
            at = rank * layout.slice_numel
            owed[at : at + layout.slice_numel].add_(owner, alpha=layout.world_size)
        rows = owed.view(-1, layout.cols)
        signs = self.signs(name, layout.cols, owed.device)
        return inverse_(rows, config.transform, signs).reshape(-1)[:numel].clone()

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "world_size": self.world_size,
            "worker": {k: v.detach().clone() for k, v in self.worker.items()},
            "owner": {k: v.detach().clone() for k, v in self.owner.items()},
            "configs": {k: dataclasses.asdict(v) for k, v in self.configs.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ConfigError(
                f"two-phase state version {state.get('version')!r} is not supported "
                f"(expected {_STATE_VERSION}); start without --resume"
            )
        saved = state["world_size"]
        if saved is not None and self.world_size is not None and saved != self.world_size:
            raise ConfigError(
                f"the two-phase residuals were saved by {saved} ranks, this group has "
                f"{self.world_size}: resume with the same number of ranks"
            )
        self.seed = int(state["seed"])
        self.world_size = saved if saved is not None else self.world_size
        self.worker = {str(k): v.clone() for k, v in state["worker"].items()}
        self.owner = {str(k): v.clone() for k, v in state["owner"].items()}
        self.configs = {str(k): TwoPhase(**v) for k, v in state["configs"].items()}
