"""The configuration of one data-parallel training run (``superneurons train``).

A frozen, validated dataclass that round-trips through JSON: the launcher writes it to
``OUT/config.json`` and every torchrun rank reads it back, so all ranks run the very same
configuration (the compression hook checks that again across ranks). ``--compress`` is parsed
once per process, here, into :attr:`TrainConfig.scheme`: the object everything after uses;
``--sync`` likewise into :attr:`TrainConfig.sync_scheme`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from superneurons.errors import ConfigError
from superneurons.schemes.adam import AdamAuto, AdamMomentum, AdamUpdate
from superneurons.schemes.anchors import TorchDense
from superneurons.schemes.compose import compose
from superneurons.schemes.diloco import DiLoCo, Sync
from superneurons.schemes.grammar import Scheme, parse_scheme, parse_sync

__all__ = ["ADAM_FAMILY", "OPTIMIZERS", "TrainConfig"]

CONFIG_VERSION = 1
OPTIMIZERS = ("sgd", "adam", "adamw")
ADAM_FAMILY = ("adam", "adamw")
BACKENDS = ("auto", "gloo", "nccl")
# Learning rates that train the zoo models on their datasets without tuning (SGD with
# momentum 0.9; Adam(W) as in nanoGPT's small char-level runs).
DEFAULT_LR = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3}


def _positive(name: str, value: Any, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"--{name.replace('_', '-')} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"--{name.replace('_', '-')} must be {bound}, got {value}")


@dataclass(frozen=True)
class TrainConfig:
    """Everything one run needs; every rank gets an identical copy."""

    model: str
    data: str
    out_dir: str
    compress: str = "dense"
    epochs: int = 1
    batch_size: int = 64
    lr: float | None = None  # None: DEFAULT_LR[optimizer]
    optimizer: str = "sgd"
    seed: int = 0
    limit_steps: int | None = None  # at most this many steps per epoch (and test batches)
    bucket_cap_mb: float = 25.0
    warmup_steps: int = 0
    error_feedback: bool = True
    data_dir: str | None = None
    block_size: int = 128  # sequence length of the char-level language models
    log_every: int = 10
    backend: str = "auto"
    resume: bool = False
    budget_bytes: int | None = None
    sync: str = "every-step"  # or diloco[...]: when ranks synchronise (parsed: sync_scheme)
    checkpoint_every: int | None = None  # also checkpoint every N steps inside an epoch
    max_grad_norm: float = 0.0  # clip the averaged gradients to this global norm (0: no)
    # Training against the clock (the demo's race over a slow link): stop after this many
    # seconds of training, evaluate every ``eval_every_s`` of them (kind="eval" records), each
    # evaluation on the first ``eval_limit`` test samples; evaluations are not counted.
    time_budget_s: float | None = None
    eval_every_s: float | None = None
    eval_limit: int | None = None
    version: int = CONFIG_VERSION

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "block_size", "log_every"):
            _positive(name, getattr(self, name))
        _positive("bucket_cap_mb", self.bucket_cap_mb)
        _positive("warmup_steps", self.warmup_steps, allow_zero=True)
        if self.lr is not None:
            _positive("lr", self.lr)
        if self.limit_steps is not None:
            _positive("limit_steps", self.limit_steps)
        if self.budget_bytes is not None:
            _positive("budget", self.budget_bytes)
        if self.checkpoint_every is not None:
            _positive("checkpoint_every", self.checkpoint_every)
        _positive("max_grad_norm", self.max_grad_norm, allow_zero=True)
        for name in ("time_budget_s", "eval_every_s", "eval_limit"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if self.backend not in BACKENDS:
            raise ConfigError(
                f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}"
            )
        if self.version != CONFIG_VERSION:
            raise ConfigError(f"config version {self.version} is not supported ({CONFIG_VERSION})")
        self.scheme  # noqa: B018  (parses --compress now: bad input fails before any rank starts)
        self.sync_scheme  # noqa: B018  (and --sync)
        if self.max_grad_norm and isinstance(self.scheme, AdamAuto | AdamMomentum | AdamUpdate):
            raise ConfigError(
                f"--max-grad-norm with --compress {self.compress!r}: that optimizer averages "
                "the gradients inside its own step, so only each rank's local gradients exist "
                "to clip; drop --max-grad-norm or use a gradient codec"
            )

    @cached_property
    def scheme(self) -> Scheme:
        """``--compress`` as one object, ``--warmup-steps`` and ``--no-error-feedback`` composed
        in: a gradient hook's compression, an Adam scheme (the optimizer communicates) or, with
        an Adam-family optimizer, ``auto``'s :class:`~superneurons.schemes.adam.AdamAuto`.

        Raises:
            ConfigError: a bad spec; an Adam scheme without an Adam-family optimizer;
                ``--warmup-steps`` or ``--no-error-feedback`` with an Adam scheme or Adam's
                ``auto`` (its warm-up is in the spec, error feedback is always on).
        """
        adam = self.optimizer in ADAM_FAMILY
        scheme = parse_scheme(self.compress, adam=adam)
        if isinstance(scheme, AdamMomentum | AdamUpdate) and not adam:
            raise ConfigError(
                f"--compress {self.compress!r} replaces the optimizer with 1-bit-Adam-style "
                f"AdamW (CompressedAdamW); pass --optimizer adamw (or adam), not {self.optimizer}"
            )
        if isinstance(scheme, AdamMomentum | AdamUpdate | AdamAuto):
            if self.warmup_steps or not self.error_feedback:
                raise ConfigError(
                    f"--compress {self.compress!r} with --optimizer {self.optimizer}: the "
                    "warm-up is part of the spec (adam-momentum[warmup=N]) and error feedback is "
                    "always on; drop --warmup-steps and --no-error-feedback"
                )
            return scheme
        return compose(scheme, error_feedback=self.error_feedback, warmup_steps=self.warmup_steps)

    @cached_property
    def sync_scheme(self) -> Sync:
        """``--sync`` as one object: ``every-step``, or DiLoCo with ``--no-error-feedback``
        composed into its wire (error feedback is on by default for a lossy codec, as with
        ``--compress``).

        Raises:
            ConfigError: a bad spec; DiLoCo with ``--compress`` or ``--warmup-steps`` (its
                wire is part of the spec: ``diloco[steps=H]:CODEC``).
        """
        sync = parse_sync(self.sync)
        if not isinstance(sync, DiLoCo):
            return sync
        if not isinstance(self.scheme, TorchDense) or self.warmup_steps:
            raise ConfigError(
                f"--sync {self.sync!r} averages no gradients: its outer gradient's codec is "
                "part of the spec (diloco[steps=H]:CODEC); drop --compress and --warmup-steps"
            )
        if sync.inner is None:
            return sync
        return replace(sync, inner=compose(sync.inner, error_feedback=self.error_feedback))

    @property
    def learning_rate(self) -> float:
        return float(self.lr) if self.lr is not None else DEFAULT_LR[self.optimizer]

    def to_json(self) -> str:
        """The fields (``compress`` as given: each process parses it once)."""
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        raw = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown training config keys {unknown}")
        return cls(**raw)

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json() + "\n", encoding="utf-8")
        return path
