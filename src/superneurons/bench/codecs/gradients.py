"""Real gradients for codec benchmarks: train zoo models briefly on real data and capture the
flat gradient DDP would communicate, at several points of training (not only at init).

Approximation error of a gradient codec depends on the gradient's spectrum and sparsity, which
change as training leaves the initial point (Wang et al., HPDC'20, measure on real training;
Agarwal et al., MLSys'22, warn that results at init do not carry over). So for each model we
train with its usual optimizer and, at every capture point ``s`` in ``steps``, record the
gradients of the ``window`` consecutive steps ``s, s + 1, ...`` (training continues through the
window), which also gives error feedback a realistic sequence to accumulate over.

Layout: the flat gradient concatenates parameters in *reverse* registration order (the order
autograd produces them and DDP fills buckets); :func:`bucket_bounds` splits it into DDP-style
buckets (whole parameters, a bucket closes once it reaches ``bucket_bytes``).

Captures are cached as ``<cache_dir>/<model>-<key>.pt`` (the key hashes the configuration), so
repeated benchmark runs only load them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from superneurons.bench.codecs.hf_models import build_hf_model
from superneurons.data import fashion_mnist, shakespeare
from superneurons.errors import ConfigError
from superneurons.models import build_model, default_loss

__all__ = [
    "CAPTURE_MODELS",
    "CaptureConfig",
    "GradientCapture",
    "bucket_bounds",
    "capture_gradients",
    "load_or_capture",
]

logger = logging.getLogger("superneurons.bench")

DDP_BUCKET_BYTES = 4 * 2**20  # the 4 MiB buckets this benchmark evaluates (DDP default: 25 MiB)


@dataclass(frozen=True)
class _Recipe:
    model: str
    dataset: str
    model_kwargs: dict[str, Any]
    optimizer: str  # "sgd" (momentum 0.9) | "adamw"
    lr: float
    batch_size: int
    source: str = "zoo"  # "zoo" (superneurons.models) | "hf" (bench.codecs.hf_models, transformers)


# NOTE: sized so 200 steps of all four take a few minutes on 2 contended CPU cores, while the
# FC-heavy net still spans several 4 MiB buckets. The LMs' vocab_size is set from the corpus.
CAPTURE_MODELS: dict[str, _Recipe] = {
    "resnet": _Recipe(
        "resnet",
        "fashion-mnist",
        {"layers": (2, 2, 2, 2), "block": "basic", "width": 16, "small_input": True,
         "in_channels": 1, "num_classes": 10},
        "sgd", 0.05, 64,
    ),
    "alexnet": _Recipe(
        "alexnet",
        "fashion-mnist",
        {"image_size": 28, "in_channels": 1, "num_classes": 10, "width_mult": 0.5,
         "fc_width": 2048, "dropout": 0.0},
        "sgd", 0.01, 32,
    ),
    "gpt": _Recipe(
        "gpt",
        "shakespeare",
        {"block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 192},
        "adamw", 1e-3, 16,
    ),
    "lstm": _Recipe(
        "lstm",
        "shakespeare",
        {"block_size": 64, "n_embd": 64, "hidden_size": 512, "num_layers": 2},
        "adamw", 2e-3, 16,
    ),
    # Architectures we did not write or tune (transformers' reference GPT-2 and ResNet-18).
    "hf-gpt2": _Recipe(
        "gpt2", "shakespeare", {"block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 192},
        "adamw", 1e-3, 16, source="hf",
    ),
    "hf-resnet": _Recipe(
        "resnet", "fashion-mnist", {"in_channels": 1, "num_classes": 10},
        "sgd", 0.05, 32, source="hf",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class CaptureConfig:
    """What to capture. ``steps``: optimizer steps taken before each capture point;
    ``window``: consecutive gradients recorded at each point; ``model_overrides`` replace
    recipe kwargs (tests use tiny models)."""

    models: tuple[str, ...] = tuple(CAPTURE_MODELS)
    steps: tuple[int, ...] = (0, 50, 200)
    window: int = 8
    seed: int = 0
    fashion_mnist_root: str = "/usr/share/datasets/fashion-mnist"
    shakespeare_root: str = "data/shakespeare"
    batch_size: int | None = None
    model_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = [m for m in self.models if m not in CAPTURE_MODELS]
        if unknown or not self.models:
            raise ConfigError(
                f"gradient capture: models {unknown or '()'} unknown; choose from "
                f"{', '.join(CAPTURE_MODELS)}"
            )
        if (
            not self.steps
            or any(s < 0 for s in self.steps)
            or list(self.steps) != sorted(set(self.steps))
        ):
            raise ConfigError(
                f"gradient capture: steps must be increasing and >= 0, got {self.steps}"
            )
        if self.window < 1:
            raise ConfigError(f"gradient capture: window must be >= 1, got {self.window}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"gradient capture: batch_size must be >= 1, got {self.batch_size}")

    def key(self, model: str) -> str:
        """Cache key of one model's capture under this configuration."""
        body = {
            "recipe": asdict(CAPTURE_MODELS[model]),
            "steps": self.steps,
            "window": self.window,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "overrides": self.model_overrides.get(model, {}),
            "version": 1,
        }
        text = json.dumps(body, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass
class GradientCapture:
    """Captured flat gradients of one model: ``grads[step]`` is ``(window, numel)`` float32."""

    model: str
    names: list[str]
    numels: list[int]
    grads: dict[int, torch.Tensor]
    losses: dict[int, float]
    train_s: float

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "model": self.model,
            "names": self.names,
            "numels": self.numels,
            "grads": self.grads,
            "losses": self.losses,
            "train_s": self.train_s,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> GradientCapture:
        if state.get("version") != 1:
            raise ConfigError("gradient cache: unknown version; delete the cache directory")
        return cls(
            model=state["model"],
            names=list(state["names"]),
            numels=list(state["numels"]),
            grads={int(k): v for k, v in state["grads"].items()},
            losses={int(k): float(v) for k, v in state["losses"].items()},
            train_s=float(state["train_s"]),
        )


def bucket_bounds(
    numels: Sequence[int], bucket_bytes: int = DDP_BUCKET_BYTES
) -> list[tuple[int, int]]:
    """``(start, stop)`` element ranges of DDP-style buckets over a flat fp32 gradient:
    consecutive whole parameters, a bucket closes once it holds ``>= bucket_bytes``."""
    if bucket_bytes < 1:
        raise ConfigError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bounds: list[tuple[int, int]] = []
    start = position = 0
    for n in numels:
        position += n
        if (position - start) * 4 >= bucket_bytes:
            bounds.append((start, position))
            start = position
    if position > start:
        bounds.append((start, position))
    return bounds


def _batches(dataset: Dataset[Any], batch_size: int, seed: int) -> Iterator[Any]:
    generator = torch.Generator().manual_seed(seed)
    while True:  # reshuffled epochs, forever
        yield from DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=generator)


def _optimizer(recipe: _Recipe, model: nn.Module) -> torch.optim.Optimizer:
    if recipe.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=recipe.lr, momentum=0.9, weight_decay=5e-4)
    return torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01)


def capture_gradients(
    model_name: str,
    config: CaptureConfig,
    *,
    progress: Callable[[int], None] | None = None,
) -> GradientCapture:
    """Train ``model_name``'s recipe and record flat gradients at ``config.steps``."""
    recipe = CAPTURE_MODELS[model_name]
    torch.manual_seed(config.seed)
    kwargs = dict(recipe.model_kwargs)
    if recipe.dataset == "fashion-mnist":
        dataset: Dataset[Any] = fashion_mnist(config.fashion_mnist_root, split="train")
    else:
        text = shakespeare(
            config.shakespeare_root, block_size=int(kwargs["block_size"]), split="train"
        )
        kwargs["vocab_size"] = len(text.vocab)
        dataset = text
    kwargs.update(config.model_overrides.get(model_name, {}))
    if recipe.source == "hf":
        model = build_hf_model(recipe.model, **kwargs)
        loss_fn = default_loss("gpt" if recipe.dataset == "shakespeare" else "resnet")
    else:
        model = build_model(recipe.model, **kwargs)
        loss_fn = default_loss(recipe.model)
    model.train()
    optimizer = _optimizer(recipe, model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad][::-1]
    batches = _batches(dataset, config.batch_size or recipe.batch_size, config.seed)
    wanted = {s + i: (s, i) for s in config.steps for i in range(config.window)}
    last = max(wanted)
    grads = {s: torch.empty(config.window, sum(p.numel() for _, p in params)) for s in config.steps}
    losses: dict[int, float] = {}
    start = time.perf_counter()
    for step in range(last + 1):
        inputs, targets = next(batches)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        if step in wanted:
            point, row = wanted[step]
            torch.cat([p.grad.reshape(-1) for _, p in params], out=grads[point][row])  # type: ignore[union-attr]
            if row == 0:
                losses[point] = float(loss.detach())
        optimizer.step()
        if progress is not None:
            progress(1)
    train_s = time.perf_counter() - start
    logger.info("captured %s: %d steps in %.1f s, losses %s", model_name, last + 1, train_s, losses)
    return GradientCapture(
        model=model_name,
        names=[n for n, _ in params],
        numels=[p.numel() for _, p in params],
        grads=grads,
        losses=losses,
        train_s=train_s,
    )


def load_or_capture(
    model_name: str,
    config: CaptureConfig,
    cache_dir: Path | None,
    *,
    progress: Callable[[int], None] | None = None,
) -> GradientCapture:
    """The cached capture for ``(model_name, config)`` if present, else capture and cache it."""
    path = (
        None if cache_dir is None else Path(cache_dir) / f"{model_name}-{config.key(model_name)}.pt"
    )
    if path is not None and path.is_file():
        logger.info("loading cached gradients %s", path)
        return GradientCapture.from_state_dict(torch.load(path, weights_only=True))
    capture = capture_gradients(model_name, config, progress=progress)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(capture.state_dict(), tmp)
        tmp.replace(path)
    return capture
