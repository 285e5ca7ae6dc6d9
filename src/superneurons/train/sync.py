"""How ranks synchronise in one training run: the optimizer, and the loop's one view of the wire.

Three ways, chosen from ``--compress`` and ``--optimizer`` (parsed once, into
:attr:`TrainConfig.scheme <superneurons.train.config.TrainConfig.scheme>`):

* a gradient codec or anchor (``fft``, ``powersgd:rank=4``, ``torch-fp16``, ``auto`` with SGD):
  DDP's comm hook (:func:`superneurons.ddp.hook.register_compression`), any optimizer;
* ``adam-momentum[warmup=N,wire=W]:CODEC`` / ``adam-update[...]:CODEC``: the optimizer itself
  communicates (:class:`~superneurons.optim.adam.CompressedAdamW`, 1-bit Adam: Tang et al.,
  ICML 2021), DDP leaves gradients local; Adam-family optimizers only;
* ``auto`` with ``--optimizer adam``/``adamw``: dense AdamW or 1-bit Adam, decided once at the
  start from the cost model (:func:`~superneurons.optim.autoadam.decide_adam_scheme`), rank 0
  deciding for all; a resumed run keeps the decision from its checkpoint.

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
from superneurons.optim.adam import CompressedAdamW
from superneurons.optim.autoadam import AdamDecision, decide_adam_scheme
from superneurons.schemes.adam import AdamAuto, AdamMomentum, AdamUpdate
from superneurons.schemes.anchors import TorchDense
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
    step, and what an fp32 all-reduce would have (warm-up steps included).
    """

    def __init__(
        self,
        *,
        requested: str,
        hook: Any = None,
        optimizer: CompressedAdamW | None = None,
        decision: AdamDecision | None = None,
    ) -> None:
        if (hook is None) == (optimizer is None):
            raise ConfigError("Synchronisation needs exactly one of a hook state or an optimizer")
        self.requested = requested
        self.hook = hook
        self.optimizer = optimizer
        self.decision = decision

    @property
    def codec(self) -> str:
        """What travels: the hook's codec spec, or the optimizer-side spec."""
        if self.optimizer is not None:
            return self.decision.scheme_spec if self.decision is not None else self.requested
        return str(self.hook.pipeline.base.spec)

    @property
    def bytes_sent_step(self) -> int:
        side = self.optimizer if self.optimizer is not None else self.hook
        return int(side.bytes_sent_step)

    @property
    def dense_bytes_step(self) -> int:
        side = self.optimizer if self.optimizer is not None else self.hook
        return int(side.dense_bytes_step)

    def summary(self) -> dict[str, Any]:
        """Fields of ``summary.json``: ``compression`` (what was asked for, composed),
        ``sync_assignment`` (the gradient hook's per-bucket ``auto``), ``sync_decision`` (the
        Adam ``auto``'s choice and its predictions)."""
        if self.hook is not None:
            fields = dict(self.hook.summary())
        else:
            fields = {"compression": self.requested, "sync_assignment": None}
        if self.decision is not None:
            fields["compression"] = self.requested
        fields["sync_decision"] = None if self.decision is None else self.decision.to_dict()
        return fields

    def state_dict(self) -> dict[str, Any]:
        """The hook's state as before for hook-only runs; otherwise the scheme, the decision and
        the hook's state (the optimizer's residuals and counters are in its own state_dict)."""
        if self.decision is None and self.optimizer is None:
            return dict(self.hook.state_dict())
        return {
            "version": _STATE_VERSION,
            "requested": self.requested,
            "scheme": self.codec,
            "decision": None if self.decision is None else self.decision.to_dict(),
            "hook": None if self.hook is None else self.hook.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.decision is None and self.optimizer is None:
            self.hook.load_state_dict(state)
            return
        if state.get("version") != _STATE_VERSION or state.get("scheme") != self.codec:
            raise ConfigError(
                f"checkpoint synchronised by {state.get('scheme')!r}, this run by "
                f"{self.codec!r}; resume with the same --compress and --optimizer"
            )
        if self.hook is not None:
            self.hook.load_state_dict(state["hook"])


def attach_synchronisation(
    config: TrainConfig,
    model: nn.Module,
    ddp: DistributedDataParallel,
    *,
    decision: AdamDecision | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> tuple[torch.optim.Optimizer, Synchronisation]:
    """The optimizer for ``model`` and the synchronisation registered on ``ddp``: the scheme
    ``auto`` decided, else ``config.scheme``. ``optimizer``: the one the loop steps when it is
    not built here (a memory plan's host optimizer, whose buckets run the comm hook)."""
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
    # auto chose dense AdamW (None): DDP's fp32 all-reduce, bytes counted
    compression = TorchDense() if scheme is None else scheme
    if isinstance(compression, AdamAuto):
        raise ConfigError("auto with an Adam-family optimizer needs its decision (decide_scheme)")
    hook = register_compression(ddp, compression, seed=config.seed)
    sync = Synchronisation(requested=config.compress, hook=hook, decision=decision)
    return optimizer, sync


def communicating_optimizer(config: TrainConfig) -> bool:
    """Whether ``config``'s synchronisation is (or may be) an optimizer that communicates
    itself (1-bit Adam), which no other optimizer can stand in for."""
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
