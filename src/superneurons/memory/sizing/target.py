"""What ``superneurons plan`` sizes: a zoo model or a Hugging Face causal LM, each a frozen
record of everything its profile depends on (read once from the command line by
``superneurons.commands.plan_target``), and the fields ``plan --json`` reports of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from superneurons.errors import ConfigError
from superneurons.memory.plan import TrainingStep
from superneurons.memory.profile_types import GRANULARITIES
from superneurons.memory.profiling.below import VARIANTS
from superneurons.memory.sizing.adapters import LoraSpec, QuantSpec
from superneurons.memory.sizing.llm import BELOW_FLOOR, LMStep, max_positions
from superneurons.memory.sizing.simulate import OPTIMIZERS

__all__ = ["BELOW", "HF", "LMTarget", "Target", "ZooTarget", "training_step"]

HF = "hf:"  # the prefix of a causal LM's spec: hf:NAME_OR_PATH
# ``--below``: which ``profiling.below.VARIANTS`` a causal LM's plan profiles besides its step
BELOW: dict[str, tuple[str, ...]] = {
    "floor": BELOW_FLOOR,
    "all": VARIANTS,
    "off": (),
}


@dataclass(frozen=True)
class ZooTarget:
    """A zoo model (``superneurons.models.zoo``) and its step, profiled on fake tensors.

    Attributes:
        name: the zoo name (``resnet``, ``resnet50``, ``gpt``, ...).
        batch_size: samples per step.
        optimizer: a key of :data:`~superneurons.memory.sizing.simulate.OPTIMIZERS`.
        granularity: one of :data:`~superneurons.memory.profile_types.GRANULARITIES`, or
            ``"auto"``: blocks or the largest blocks split, whichever floor is lower.
        image_size / depth / preset: the model's own options (``depth``: ``resnet`` only;
            ``preset``: ``gpt`` only), None where left to the model.
        max_grad_norm: the loop clips gradients to this global norm (0: it does not).
    """

    name: str
    batch_size: int = 16
    optimizer: str = "sgd"
    granularity: str = "auto"
    image_size: int | None = None
    depth: int | None = None
    preset: str | None = None
    max_grad_norm: float = 0.0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"--batch must be >= 1, got {self.batch_size}")
        if self.depth is not None and self.name != "resnet":
            raise ConfigError(
                "--depth applies to --model resnet only; use resnet50/101/152 by name"
            )
        if self.granularity not in (*GRANULARITIES, "auto"):
            raise ConfigError(
                f"unknown granularity {self.granularity!r}: use one of "
                f"{', '.join((*GRANULARITIES, 'auto'))}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"unknown optimizer {self.optimizer!r}: use one of {', '.join(OPTIMIZERS)}"
            )

    def model_kwargs(self) -> dict[str, Any]:
        """The zoo builder's options that were given (``profile_zoo(**model_kwargs)``)."""
        given = {"image_size": self.image_size, "depth": self.depth, "preset": self.preset}
        return {k: v for k, v in given.items() if v is not None}

    def record(self) -> dict[str, Any]:
        """Its ``plan --json`` fields."""
        record = {"model": self.name, **self.model_kwargs(), "batch": self.batch_size}
        return {**record, **_step_fields(self)}


@dataclass(frozen=True)
class LMTarget:
    """A causal LM built from a ``transformers`` configuration, and its step.

    Attributes:
        name: a shipped configuration's name (``superneurons.models.hf_configs``) or a path to
            a ``config.json``: the spec without its ``hf:``.
        config: the ``transformers`` configuration.
        config_source: where the configuration comes from (a URL or a resolved path).
        step: the training step (:class:`~superneurons.memory.sizing.llm.LMStep`).
        below: a key of :data:`BELOW`: the profiles below the largest layer a plan searches.
        max_grad_norm: the loop clips gradients to this global norm (0: it does not).
        beyond_positions: the step's sequence may be longer than the configuration's
            positions (rotary positions only): what memory it would take.
    """

    name: str
    config: Any
    config_source: str
    step: LMStep
    below: str = "floor"
    max_grad_norm: float = 0.0
    beyond_positions: bool = False

    def __post_init__(self) -> None:
        if self.below not in BELOW:
            raise ConfigError(f"below must be one of {', '.join(BELOW)}, got {self.below!r}")

    @property
    def spec(self) -> str:
        return HF + self.name

    @property
    def max_positions(self) -> int | None:
        return max_positions(self.config)

    @property
    def variants(self) -> tuple[str, ...]:
        return BELOW[self.below]

    def record(self) -> dict[str, Any]:
        """Its ``plan --json`` fields."""
        step = self.step
        return {
            "model": self.spec,
            "config_source": self.config_source,
            "seq_len": step.seq_len,
            "batch": step.batch_size,
            "dtype": step.dtype,
            "autocast": step.autocast,
            "optimizer": step.optimizer,
            "optimizer_impl": step.optimizer_impl,
            "target_device": step.target_device,
            "keep_outputs": step.keep_outputs,
            "max_positions": self.max_positions,
            **self.adapter_record(),
            **_step_fields(self),
        }

    @property
    def lora(self) -> LoraSpec | None:
        """The LoRA adapters the step trains (``--lora``; None: a full fine-tune)."""
        return self.step.lora

    @property
    def quantize(self) -> QuantSpec | None:
        """The frozen base's storage (``--quantize``; None: the parameters' dtype)."""
        return self.step.quantize

    def adapter_record(self) -> dict[str, Any]:
        """``adapter`` and ``quantize`` (``plan --json``), only when adapters train: the
        record of a full fine-tune is as it was."""
        if self.lora is None:
            return {}
        quantize = None if self.quantize is None else self.quantize.record()
        return {"adapter": self.lora.record(), "quantize": quantize}


Target = ZooTarget | LMTarget


def training_step(target: Target) -> TrainingStep | None:
    """The training step ``target`` is planned for: clipping by the global norm where its
    ``max_grad_norm`` says so, else None (the plain step)."""
    if not target.max_grad_norm:
        return None
    return TrainingStep(max_grad_norm=target.max_grad_norm)


def _step_fields(target: Target) -> dict[str, Any]:
    """``plan --json``'s keys for clipping, where the target clips, and ``beyond_positions``,
    where a causal LM's one plan runs past its positions (absent otherwise: the records of
    other targets read as they always have)."""
    fields: dict[str, Any] = {"max_grad_norm": target.max_grad_norm} if target.max_grad_norm else {}
    if isinstance(target, LMTarget) and target.beyond_positions:
        fields["beyond_positions"] = True
    return fields
