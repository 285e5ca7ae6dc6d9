"""How ranks synchronise in one training run: the optimizer, and the loop's one view of the wire.

Every step, in three ways chosen from ``--compress`` and ``--optimizer`` (parsed once, into
:attr:`TrainConfig.scheme <superneurons.train.config.TrainConfig.scheme>`):

* a gradient codec or anchor (``fft``, ``powersgd:rank=4``, ``torch-fp16``, ``auto`` with SGD):
  DDP's comm hook (:func:`superneurons.ddp.hook.register_compression`), any optimizer;
* ``adam-momentum[warmup=N,wire=W]:CODEC`` / ``adam-update[...]:CODEC``: the optimizer itself
  communicates (:class:`~superneurons.optim.adam.CompressedAdamW`, 1-bit Adam: Tang et al.,
  ICML 2021), DDP leaves gradients local; Adam-family optimizers only;
* ``auto`` with ``--optimizer adam``/``adamw``: dense AdamW or 1-bit Adam, decided once at the
  start from the cost model (:func:`~superneurons.optim.autoadam.decide_adam_scheme`), rank 0
  deciding for all; a resumed run keeps the decision from its checkpoint.

Or every H steps, with ``--sync diloco[...]`` (:attr:`TrainConfig.sync_scheme`): DiLoCo's
outer step on the averaged outer gradient (:mod:`superneurons.localsgd`), any optimizer as the
inner one, DDP leaving gradients local.

:class:`Synchronisation` gives the loop the same surface in every case: bytes this step, the
summary fields, and the state that goes into each rank's checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from superneurons.ddp.hook import register_compression
from superneurons.ddp.local import register_local_gradients
from superneurons.errors import ConfigError
from superneurons.localsgd.diloco import LocalSGD, attach_local_sgd
from superneurons.optim.adam import CompressedAdamW
from superneurons.optim.autoadam import AdamDecision, decide_adam_scheme
from superneurons.replicas import check_replicas
from superneurons.schemes.adam import AdamAuto, AdamMomentum, AdamUpdate
from superneurons.schemes.anchors import TorchDense
from superneurons.schemes.diloco import DiLoCo
from superneurons.train.config import TrainConfig

__all__ = [
    "Synchronisation",
    "attach_synchronisation",
    "build_optimizer",
    "communicating_optimizer",
    "decide_scheme",
]

_STATE_VERSION = 1


def decide_scheme(
    config: TrainConfig,
    model: nn.Module,
    *,
    batch: Callable[[], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    total_steps: int,
    saved: dict[str, Any] | None,
) -> AdamDecision | None:
    """``auto`` with Adam(W): the decision (from the checkpoint when resuming, else measured
    now: collective, before DDP wraps ``model``); None for every other ``--compress``."""
    auto = config.scheme
    if not isinstance(auto, AdamAuto):
        return None
    if saved is not None:
        return AdamDecision.from_dict(saved["decision"])
    return decide_adam_scheme(
        model,
        batch(),
        loss_fn,
        config=auto,
        total_steps=total_steps,
        bucket_cap_bytes=int(config.bucket_cap_mb * 2**20),
    )


class Synchronisation:
    """The loop's view of the wire, whichever side communicates.

    ``bytes_sent_step``/``dense_bytes_step``: the payload this rank put on the wire in the last
    step, and what an fp32 all-reduce would have (warm-up steps included). Exactly one of
    ``hook`` (a gradient hook's state), ``optimizer`` (one that communicates) or ``local_sgd``
    (DiLoCo's outer loop) communicates.
    """

    def __init__(
        self,
        *,
        requested: str,
        hook: Any = None,
        optimizer: CompressedAdamW | None = None,
        decision: AdamDecision | None = None,
        local_sgd: LocalSGD | None = None,
    ) -> None:
        if sum(side is not None for side in (hook, optimizer, local_sgd)) != 1:
            raise ConfigError(
                "Synchronisation needs exactly one of a hook state, an optimizer or a LocalSGD"
            )
        self.requested = requested
        self.hook = hook
        self.optimizer = optimizer
        self.decision = decision
        self.local_sgd = local_sgd

    @property
    def codec(self) -> str:
        """What travels: the hook's codec spec, the optimizer-side spec, or DiLoCo's wire."""
        if self.local_sgd is not None:
            return self.local_sgd.transport.spec
        if self.optimizer is not None:
            return self.decision.scheme_spec if self.decision is not None else self.requested
        return str(self.hook.pipeline.base.spec)

    @property
    def _side(self) -> Any:
        return next(s for s in (self.local_sgd, self.optimizer, self.hook) if s is not None)

    @property
    def bytes_sent_step(self) -> int:
        return int(self._side.bytes_sent_step)

    @property
    def dense_bytes_step(self) -> int:
        return int(self._side.dense_bytes_step)

    def after_step(self, *, end_of_epoch: bool) -> None:
        """After each optimizer step: DiLoCo counts it and synchronises when its window is
        full or the epoch ends (so every epoch ends with one model on every rank); the other
        ways have communicated already."""
        if self.local_sgd is not None:
            self.local_sgd.step(end_of_window=end_of_epoch)

    def check_replicas(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """:func:`~superneurons.replicas.check_replicas` on what must be equal across ranks:
        the model and the optimizer; the model only with 1-bit Adam (its residuals and
        moments are per rank); with DiLoCo the synced parameters and the outer optimizer
        (inner optimizers and mid-window models are per rank)."""
        group = getattr(model, "process_group", None)
        if self.local_sgd is not None:
            with self.local_sgd.synced_weights():
                check_replicas(model, optimizers=[self.local_sgd.outer], process_group=group)
            return
        replicated = [] if isinstance(optimizer, CompressedAdamW) else [optimizer]
        check_replicas(model, optimizers=replicated, process_group=group)

    def summary(self) -> dict[str, Any]:
        """Fields of ``summary.json``: ``compression`` (what was asked for, composed),
        ``sync_assignment`` (the gradient hook's per-bucket ``auto``), ``sync_decision`` (the
        Adam ``auto``'s choice and its predictions)."""
        if self.hook is not None:
            fields = dict(self.hook.summary())
        elif self.local_sgd is not None:
            fields = {"compression": str(self.local_sgd.config), "sync_assignment": None}
            fields.update(self.local_sgd.summary())
        else:
            fields = {"compression": self.requested, "sync_assignment": None}
        if self.decision is not None:
            fields["compression"] = self.requested
        fields["sync_decision"] = None if self.decision is None else self.decision.to_dict()
        fields.setdefault("sync", "every-step")
        return fields

    def state_dict(self) -> dict[str, Any]:
        """The hook's state as before for hook-only runs; otherwise the scheme, the decision and
        the hook's state (the optimizer's residuals and counters are in its own state_dict)."""
        if self.decision is None and self.optimizer is None and self.local_sgd is None:
            return dict(self.hook.state_dict())
        state = {
            "version": _STATE_VERSION,
            "requested": self.requested,
            "scheme": self.codec,
            "decision": None if self.decision is None else self.decision.to_dict(),
            "hook": None if self.hook is None else self.hook.state_dict(),
        }
        if self.local_sgd is not None:
            state["local_sgd"] = self.local_sgd.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.decision is None and self.optimizer is None and self.local_sgd is None:
            self.hook.load_state_dict(state)
            return
        if state.get("version") != _STATE_VERSION or state.get("scheme") != self.codec:
            raise ConfigError(
                f"checkpoint synchronised by {state.get('scheme')!r}, this run by "
                f"{self.codec!r}; resume with the same --compress and --optimizer"
            )
        if self.hook is not None:
            self.hook.load_state_dict(state["hook"])
        if self.local_sgd is not None:
            self.local_sgd.load_state_dict(state["local_sgd"])


def attach_synchronisation(
    config: TrainConfig,
    model: nn.Module,
    ddp: DistributedDataParallel,
    *,
    decision: AdamDecision | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> tuple[torch.optim.Optimizer, Synchronisation]:
    """The optimizer for ``model`` and the synchronisation registered on ``ddp``: DiLoCo when
    ``--sync`` names it, else the scheme ``auto`` decided, else ``config.scheme``.
    ``optimizer``: the one the loop steps when it is not built here (a memory plan's host
    optimizer, whose buckets run the comm hook)."""
    scheme = config.scheme if decision is None else decision.scheme
    lr = config.learning_rate
    decay = _weight_decay(config)
    if isinstance(scheme, AdamMomentum | AdamUpdate):
        if optimizer is not None:
            raise ConfigError(f"--compress {config.compress} is an optimizer of its own")
        register_local_gradients(ddp)
        adam = CompressedAdamW(
            model.parameters(), lr=lr, weight_decay=decay, seed=config.seed, **scheme.kwargs()
        )
        return adam, Synchronisation(requested=config.compress, optimizer=adam, decision=decision)
    if optimizer is None:
        optimizer = build_optimizer(config, list(model.parameters()))
    if isinstance(config.sync_scheme, DiLoCo):  # the inner optimizer; DDP leaves grads local
        local_sgd = attach_local_sgd(ddp, config.sync_scheme, seed=config.seed)
        return optimizer, Synchronisation(requested=config.sync, local_sgd=local_sgd)
    # auto chose dense AdamW (None): DDP's fp32 all-reduce, bytes counted
    compression = TorchDense() if scheme is None else scheme
    if isinstance(compression, AdamAuto):
        raise ConfigError("auto with an Adam-family optimizer needs its decision (decide_scheme)")
    hook = register_compression(ddp, compression, seed=config.seed)
    sync = Synchronisation(requested=config.compress, hook=hook, decision=decision)
    return optimizer, sync


def communicating_optimizer(config: TrainConfig) -> bool:
    """Whether ``config``'s synchronisation is (or may be) an optimizer that communicates
    itself (1-bit Adam) or steps locally between synchronisations (DiLoCo), which no other
    optimizer can stand in for."""
    if isinstance(config.sync_scheme, DiLoCo):
        return True
    return isinstance(config.scheme, AdamAuto | AdamMomentum | AdamUpdate)


def build_optimizer(config: TrainConfig, params: list[Any]) -> torch.optim.Optimizer:
    """``--optimizer`` over ``params`` (SGD with momentum 0.9, Adam, AdamW with decay 0.01)."""
    lr = config.learning_rate
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr, weight_decay=_weight_decay(config))


def _weight_decay(config: TrainConfig) -> float:
    return 0.01 if config.optimizer == "adamw" else 0.0
