"""The convergence benchmark's configuration: which codec labels, on which tasks, how many ranks.

Every codec trains the same model from the same initial weights on the same data order with
2 gloo ranks on loopback (one thread each), through ``register_compression`` with its
defaults (error feedback on). Two tasks:

* Fashion-MNIST (Xiao et al., 2017) image classification, the same epochs for every codec;
  the metric is test accuracy in percentage points;
* character-level Shakespeare (the char-rnn/nanoGPT task) with a small GPT and fewer steps;
  the metric is validation cross-entropy (nats per character).

Wang et al. (HPDC'20) report FFT compression at the accuracy of uncompressed training; our
target: the default FFT within 0.5 points of dense on Fashion-MNIST. The labels are read once,
here (:attr:`ConvergenceConfig.labels`, see :mod:`.labels`), so a bad one fails before any rank
starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from superneurons.bench.convergence.labels import Label, read_label
from superneurons.errors import ConfigError
from superneurons.optim.stepcost import ComputeTimes

__all__ = [
    "CONVERGENCE_CODECS",
    "FASHION_MNIST",
    "SHAKESPEARE",
    "ConvergenceConfig",
    "TaskConfig",
]

CONVERGENCE_CODECS: tuple[str, ...] = (
    "dense",
    "fft",
    "topk",
    "qsgd",
    "terngrad",
    "signsgd",
    "powersgd:rank=4",
    "torch-powersgd:rank=4",
    "adam-momentum[warmup=20,wire=fp16]:signsgd",
)


@dataclass(frozen=True)
class TaskConfig:
    """One training task: ``task`` is ``fashion-mnist`` or ``shakespeare``."""

    task: str
    model: str
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    steps: int = 0  # 0: whole epochs (``epochs``) over the training shard
    epochs: int = 1
    batch_size: int = 64  # per rank
    lr: float = 0.05
    optimizer: str = "sgd"  # "sgd" (momentum 0.9), "adam" or "adamw" (weight decay 0.01)
    train_limit: int = 0  # 0: the whole training set; else its first N samples
    eval_points: int = 8  # metric evaluations along the run (the curve), last = final
    eval_limit: int = 0  # 0: the whole test/val set for the final point

    def __post_init__(self) -> None:
        if self.task not in ("fashion-mnist", "shakespeare"):
            raise ConfigError(f"task must be fashion-mnist or shakespeare, got {self.task!r}")
        if self.optimizer not in ("sgd", "adam", "adamw"):
            raise ConfigError(f"optimizer must be sgd, adam or adamw, got {self.optimizer!r}")
        if self.steps < 0 or self.epochs < 1 or self.batch_size < 1 or self.eval_points < 1:
            raise ConfigError("steps >= 0, epochs >= 1, batch_size >= 1, eval_points >= 1")


FASHION_MNIST = TaskConfig("fashion-mnist", "mlp", epochs=2, batch_size=64, lr=0.05)
SHAKESPEARE = TaskConfig(
    "shakespeare",
    "gpt",
    {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
    steps=200,
    batch_size=16,
    lr=3e-3,
    optimizer="adamw",
    eval_points=5,
    eval_limit=256,
)


@dataclass(frozen=True)
class ConvergenceConfig:
    """Which codecs, on which tasks, with how many ranks."""

    codecs: tuple[str, ...] = CONVERGENCE_CODECS
    tasks: tuple[TaskConfig, ...] = (FASHION_MNIST, SHAKESPEARE)
    nproc: int = 2
    seed: int = 0
    fashion_mnist_root: str = "/usr/share/datasets/fashion-mnist"
    shakespeare_root: str = "data/shakespeare"
    timeout_s: float = 1800.0
    bandwidth_bit_s: int | None = None  # None: loopback; else a link shaped to this rate
    # ``auto`` with Adam: the compute its decision takes (backward and optimizer step times);
    # None: measured on rank 0 (then the decision depends on how busy the machine is)
    adam_compute: ComputeTimes | None = None

    def __post_init__(self) -> None:
        if "dense" not in self.codecs:
            raise ConfigError("the convergence benchmark needs 'dense' as its reference codec")
        if self.nproc < 1:
            raise ConfigError(f"nproc must be >= 1, got {self.nproc}")
        self.labels  # noqa: B018  (reads every label now: bad input fails before any rank starts)

    @cached_property
    def labels(self) -> tuple[Label, ...]:
        """``codecs`` read once: what each label runs on each task (:func:`.labels.read_label`)."""
        return tuple(read_label(text) for text in self.codecs)

    @staticmethod
    def quick() -> ConvergenceConfig:
        """Three codecs, one Fashion-MNIST epoch on 12k images, 60 Shakespeare steps."""
        return ConvergenceConfig(
            codecs=("dense", "fft", "topk"),
            tasks=(
                replace(FASHION_MNIST, epochs=1, train_limit=12_000, eval_points=4),
                replace(SHAKESPEARE, steps=60, eval_points=3),
            ),
        )
