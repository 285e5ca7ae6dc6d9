"""The step a trainer runs on one batch (``loss_of(model, batch)``), profiled as one module: the
plain step, and the same step below its largest layer.

:func:`~superneurons.integrations.hf.plan_for_batch` profiles through :class:`BatchStep`: the
trainer's own forward in training mode, isolated (:mod:`superneurons.memory.profiling.isolate`),
with the loop's optimizer state and what the loop keeps of the output. :meth:`BatchStep.below`
profiles the same step with a causal LM's head + loss in chunks of tokens and block MLPs over
pieces of the sequence (:func:`superneurons.memory.below_profiles`). The head is found through
``get_output_embeddings()`` wherever it lives (:func:`superneurons.memory.chunked.lmhead.
find_output_embedding`): behind PEFT's ``PeftModelForCausalLM`` -> ``LoraModel`` wrappers, an
adapter fine-tune goes below its head as a full one does; TRL's fused head runs in chunks too
(:mod:`superneurons.memory.chunked.fused`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from superneurons.errors import ConfigError
from superneurons.integrations.no_trace import no_trace
from superneurons.memory import Profile, below_profiles, profile_step
from superneurons.memory.profiling.step import output_loss

__all__ = ["PREFIX", "BatchStep", "LossOf", "model_loss"]

PREFIX = "model."  # the step module's one child: unit fqns are the model's behind it

LossOf = Callable[[nn.Module, Mapping[str, Any]], Any]
"""How a trainer gets the loss of one batch: ``loss_of(model, batch)`` returns the loss tensor,
or an output holding it as ``loss`` (e.g. TRL's ``model(**batch, fused_lm_head=True)``)."""


def model_loss(model: nn.Module, batch: Mapping[str, Any]) -> Any:
    """``model(**batch)``: HF Trainer's and accelerate's step (the output's ``loss``)."""
    return model(**batch)


class _BatchLoss(nn.Module):
    """``batch -> loss_of(model, batch)``: the step a trainer runs, as one module to profile.

    Its only child is named ``model``, so unit fqns are the model's own behind ``"model."``.
    """

    def __init__(self, model: nn.Module, loss_of: LossOf, *, whole_output: bool = False) -> None:
        super().__init__()
        self.model = model
        self.loss_of = loss_of
        self.whole_output = whole_output  # the loop keeps the output, not only its loss

    def forward(self, batch: Mapping[str, Any]) -> Any:
        output = self.loss_of(self.model, batch)
        if isinstance(output, torch.Tensor):
            return output
        if self.whole_output:
            _loss_of_output(output)  # checked now: the same message as below
            return output
        return _loss_of_output(output)


def _loss_of_output(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        raise ConfigError(
            "the model returned no loss for the sample batch: include the labels in it "
            "(e.g. batch['labels'] = batch['input_ids'] for a causal LM)"
        )
    return loss


@dataclass(frozen=True)
class BatchStep:
    """One trainer step on ``batch``, as the trainer runs it.

    Attributes:
        model: the unwrapped model; units: its fqns a plan decides for.
        loss_of: the trainer's forward; keep_outputs: the loop keeps the whole output through
            backward and the step (HF's ``no_trainer`` examples); autocast: the forward's dtype.
    """

    model: nn.Module
    batch: Mapping[str, Any]
    optimizer: torch.optim.Optimizer | None
    units: list[str]
    loss_of: LossOf
    keep_outputs: bool
    autocast: torch.dtype | None

    def _options(self) -> dict[str, Any]:
        return dict(
            units=[PREFIX + fqn for fqn in self.units],
            keep_output=True,
            carry_output=self.keep_outputs,
            autocast=self.autocast,
        )

    def _loss_fn(self) -> Callable[[Any, Any], torch.Tensor]:
        return output_loss if self.keep_outputs else _loss_is_output

    def profile(self) -> Profile:
        """The step profiled per unit, checked to have run in the units."""
        step = _BatchLoss(self.model, self.loss_of, whole_output=self.keep_outputs)
        # trainers call model.train() before every step; a failing profile leaves no trace
        with no_trace(self.model), _training_mode(self.model):
            profile = profile_step(
                step, dict(self.batch), None, self._loss_fn(), self.optimizer, **self._options()
            )
        _check_observed(profile, self.model, self.units)
        return profile

    def below(self, profile: Profile) -> list[Profile]:
        """The step profiled below its largest layer (``[]`` for a model without a head or
        MLPs to chunk, or a batch without ``input_ids``/``labels`` to count tokens by)."""
        shape = _token_shape(self.batch)
        if shape is None:
            return []
        step = _BatchLoss(self.model, self.loss_of, whole_output=self.keep_outputs)
        with no_trace(self.model), _training_mode(self.model):
            return below_profiles(
                step,
                dict(self.batch),
                None,
                self._loss_fn(),
                self.optimizer,
                profile=profile,
                tokens=shape[0] * shape[1],
                seq_len=shape[1],
                # NOTE: the head's gradients bit for bit the unchunked loss's (recompute, +33%
                # of the head's FLOPs): a plan changes the memory, not the training
                impl="exact",
                **self._options(),
            )


def _token_shape(batch: Mapping[str, Any]) -> tuple[int, int] | None:
    """``(B, T)`` of the batch's token ids (``labels`` or ``input_ids``), None without."""
    for key in ("labels", "input_ids"):
        ids = batch.get(key)
        if isinstance(ids, torch.Tensor) and ids.dim() == 2:
            return int(ids.shape[0]), int(ids.shape[1])
    return None


def _loss_is_output(output: torch.Tensor, _targets: Any) -> torch.Tensor:
    return output


@contextmanager
def _training_mode(model: nn.Module) -> Iterator[None]:
    """``model.train()`` inside the block; every module's own mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _check_observed(profile: Profile, model: nn.Module, chosen: list[str]) -> None:
    """A profile in which no unit ran is a wrong seam, not a budget problem: say so."""
    shown = ", ".join(chosen[:3]) + (", ..." if len(chosen) > 3 else "")
    if not profile.units:
        raise ConfigError(
            f"no units were observed: none of {shown} ran in the profiled step, so there is "
            f"nothing to plan; {type(model).__name__}'s forward does not reach its own blocks "
            "(is forward replaced by one that runs another module, or compiled?): pass the "
            "module that really runs, or units= naming modules the step calls"
        )
