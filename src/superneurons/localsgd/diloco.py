"""DiLoCo's outer loop around any inner optimizer (Douillard et al., arXiv 2311.08105).

Each rank steps its own (inner) optimizer on its own shard; nothing is communicated for ``H``
steps (``DiLoCo.steps``). Then, with ``θ`` the parameters every rank held at the last
synchronisation and ``θ_r`` this rank's::

    Δ_r = θ − θ_r                      the outer gradient, per parameter (fp32)
    Δ   = average_r Δ_r                 one collective (:mod:`.transport`: fp32, a codec + EF)
    θ   ← OuterSGD(θ, Δ)                torch.optim.SGD(lr, momentum, nesterov): the paper's
                                        Nesterov outer step (lr 0.7, momentum 0.9)
    θ_r ← θ                             on every rank: the next window starts from one model

The outer optimizer is a plain ``torch.optim.SGD`` over the model's own parameters (the
outer step swaps ``θ`` in, sets ``.grad = Δ``, steps, and restores the inner gradients), so its
state is keyed like the inner optimizer's. With ``lr=1, momentum=0`` it is model averaging
(local SGD, Stich, ICLR 2019), and with ``H=1`` and a linear inner optimizer (SGD with or
without momentum) it is data-parallel SGD up to float rounding (``Δ`` is a difference of
parameters, rounded to their ulp, where DDP averages gradients).

:class:`LocalSGD` holds what a resume needs besides the model and the inner optimizer (both
per rank): the synced parameters, the outer optimizer, the wire's residuals, and the position
in the window (``inner_steps``). ``attach_local_sgd`` is the public verb.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from superneurons.ddp.local import register_local_gradients
from superneurons.errors import ConfigError
from superneurons.localsgd.transport import Transport, transport_for
from superneurons.schemes.diloco import DiLoCo

__all__ = ["LocalSGD", "attach_local_sgd"]

_STATE_VERSION = 1


class LocalSGD:
    """The outer loop of DiLoCo over ``named_parameters`` (see the module docs).

    Call :meth:`step` after every inner optimizer step: it closes the window after
    ``config.steps`` of them (or when ``end_of_window`` is set) with one :meth:`sync`.
    ``bytes_sent_step``/``dense_bytes_step``: what this rank sent in the last step, and what an
    fp32 gradient all-reduce would have (every step); ``*_total`` over the run.
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, nn.Parameter]],
        config: DiLoCo,
        *,
        transport: Transport,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(config, DiLoCo):
            raise ConfigError(f"LocalSGD needs a DiLoCo config, got {config!r}")
        self.config = config
        self.transport = transport
        self.process_group = process_group
        self.named = [(name, p) for name, p in named_parameters if p.requires_grad]
        if not self.named:
            raise ConfigError("LocalSGD: the model has no trainable parameters")
        self.synced = [p.detach().clone() for _, p in self.named]
        momentum = config.outer_momentum
        self.outer = torch.optim.SGD(
            [p for _, p in self.named],
            lr=config.outer_lr,
            momentum=momentum,
            nesterov=config.nesterov and momentum > 0,
        )
        self.wire = transport.new_state()
        self.inner_steps = 0  # inner steps since the last synchronisation (the window position)
        self.rounds = 0  # synchronisations so far
        self.bytes_sent_step = self.dense_bytes_step = 0
        self.bytes_sent_total = self.dense_bytes_total = 0

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.named)

    def step(self, *, end_of_window: bool = False) -> bool:
        """Count one inner step; synchronise when the window is full or ``end_of_window``.
        Collective on the steps that synchronise (the same steps on every rank). Returns
        whether it synchronised."""
        self.inner_steps += 1
        self.dense_bytes_step = 4 * self.numel
        self.dense_bytes_total += self.dense_bytes_step
        self.bytes_sent_step = 0
        if self.inner_steps < self.config.steps and not end_of_window:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> int:
        """Close the window now: average the outer gradient, take the outer step, start every
        rank from the result. Collective; a no-op (0 bytes) when no inner step was taken since
        the last one. Returns the bytes this rank sent."""
        if self.inner_steps == 0:
            return 0
        deltas = [  # Δ_r = θ − θ_r, fresh fp32 tensors the transport averages in place
            (name, (synced.float() - p.float()).reshape(-1))
            for (name, p), synced in zip(self.named, self.synced, strict=True)
        ]
        sent = self.transport.average(deltas, self.wire)
        inner_grads = [p.grad for _, p in self.named]
        for (_, p), synced, (_, delta) in zip(self.named, self.synced, deltas, strict=True):
            p.copy_(synced)
            p.grad = delta.view_as(p).to(p.dtype)
        self.outer.step()
        for (_, p), synced, grad in zip(self.named, self.synced, inner_grads, strict=True):
            p.grad = grad
            synced.copy_(p)
        self.inner_steps = 0
        self.rounds += 1
        self.bytes_sent_step = sent
        self.bytes_sent_total += sent
        return sent

    @contextlib.contextmanager
    def synced_weights(self) -> Iterator[None]:
        """Inside, the parameters hold the last synchronised ``θ`` (the same on every rank:
        what to evaluate, or compare across ranks, mid-window); the rank's own come back after."""
        with torch.no_grad():
            local = [p.detach().clone() for _, p in self.named]
            for (_, p), synced in zip(self.named, self.synced, strict=True):
                p.copy_(synced)
        try:
            yield
        finally:
            with torch.no_grad():
                for (_, p), mine in zip(self.named, local, strict=True):
                    p.copy_(mine)

    def summary(self) -> dict[str, Any]:
        """Fields for a run's summary: the scheme, its rounds and the wire."""
        return {
            "sync": str(self.config),
            "sync_rounds": self.rounds,
            "sync_wire": self.transport.spec,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything but the model and the inner optimizer: the synced parameters (by name),
        the outer optimizer, the wire's state, the window position and the byte counters."""
        return {
            "version": _STATE_VERSION,
            "scheme": str(self.config),
            "inner_steps": self.inner_steps,
            "rounds": self.rounds,
            "synced": {
                name: s.detach().to("cpu", copy=True)
                for (name, _), s in zip(self.named, self.synced, strict=True)
            },
            "outer": self.outer.state_dict(),
            "wire": self.wire.state_dict(),
            "bytes_sent_total": self.bytes_sent_total,
            "dense_bytes_total": self.dense_bytes_total,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION or state.get("scheme") != str(self.config):
            raise ConfigError(
                f"checkpoint synchronised by {state.get('scheme')!r}, this run by "
                f"{str(self.config)!r}; resume with the same --sync"
            )
        names = [name for name, _ in self.named]
        if list(state["synced"]) != names:
            raise ConfigError("the checkpoint's synced parameters are not this model's")
        with torch.no_grad():
            for synced, saved in zip(self.synced, state["synced"].values(), strict=True):
                synced.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        self.wire.load_state_dict(state["wire"])
        self.inner_steps = int(state["inner_steps"])
        self.rounds = int(state["rounds"])
        self.bytes_sent_total = int(state["bytes_sent_total"])
        self.dense_bytes_total = int(state["dense_bytes_total"])


def attach_local_sgd(
    model: nn.Module,
    config: DiLoCo,
    *,
    process_group: dist.ProcessGroup | None = None,
    seed: int = 0,
) -> LocalSGD:
    """DiLoCo on ``model``: a DDP model's gradients stay local from now on (no all-reduce in
    backward); step the inner optimizer as usual and call ``.step()`` after it.

    ``seed`` seeds stochastic codecs on the wire (per rank, round and parameter).
    """
    if isinstance(model, DistributedDataParallel):
        register_local_gradients(model)
        process_group = process_group or model.process_group
        model = model.module
    transport = transport_for(config, group=process_group, seed=seed)
    return LocalSGD(
        model.named_parameters(), config, transport=transport, process_group=process_group
    )
