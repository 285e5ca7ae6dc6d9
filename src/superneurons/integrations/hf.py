"""Memory plans for models trained on a batch dict: ``loss = model(**batch).loss`` (HF style).

Hugging Face models (and the loops of ``transformers.Trainer`` and ``accelerate``) call the
model with keyword arguments and read the loss from its output. :func:`plan_for_batch` runs
SuperNeurons' three verbs on such a model (Wang et al., PPoPP'18; ``superneurons.memory``):
profile one real step on ``batch`` (on a copy: the model, its gradients and the optimizer are
untouched), plan keep / offload / recompute per transformer block under a byte budget, and
return the plan with unit fqns relative to the model, ready for ``apply_plan(model, plan)``.

Two things HF models need that plain modules do not:

* **The key/value cache.** With ``config.use_cache=True`` (GPT-2's default) a training forward
  also fills a ``DynamicCache``; a recomputed block appends its keys and values a second time
  (on CUDA this crashed with 2048 vs 1024 positions, and on CPU it exceeded the budget). Measured here in one run (GPT-2, 6 layers, width 256, batch 8 x 256, AdamW, recompute
  plans): without the cache the measured step peak equals the plan's prediction to the byte;
  with it, the peak exceeds the prediction by 8.6% at a 70% budget and 19% at 50% (the budget
  itself by 4%). :func:`training_without_kv_cache` sets ``use_cache=False`` while training, as
  HF does itself under gradient checkpointing (transformers 5's ``Trainer`` already sets
  ``config.use_cache = args.use_cache``, False by default; plain loops keep the config's).
* **No optimizer-in-backward.** These models train under DDP here, where stepping a parameter
  inside backward would step it before its gradient is averaged: plans never choose it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory import Plan, default_units, make_plan, profile_step

__all__ = ["plan_for_batch", "training_without_kv_cache"]

logger = logging.getLogger("superneurons.integrations")

_PREFIX = "model."


class _BatchLoss(nn.Module):
    """``batch -> model(**batch).loss``: the step HF's Trainer runs, as one module to profile.

    Its only child is named ``model``, so unit fqns are the model's own behind ``"model."``.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        output = self.model(**batch)
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if loss is None:
            raise ConfigError(
                "the model returned no loss for the sample batch: include the labels in it "
                "(e.g. batch['labels'] = batch['input_ids'] for a causal LM)"
            )
        return loss


def plan_for_batch(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    budget_bytes: int | None = None,
    budget_fraction: float | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    strategy: str = "auto",
    units: list[str] | None = None,
    **plan_options: Any,
) -> Plan:
    """Profile one step of ``model(**batch).loss`` and plan it under a device-memory budget.

    Args:
        model: the (unwrapped) model, e.g. a ``transformers.PreTrainedModel``.
        batch: one real training batch, on the model's device, with the labels.
        budget_bytes: the device byte budget for one training step; or
        budget_fraction: the budget as a fraction in (0, 1] of the profiled eager peak.
        optimizer: the optimizer, so its state counts in the peak (optional).
        strategy: as for :func:`superneurons.memory.make_plan` (``auto`` by default).
        units: module fqns a plan decides for (default: the blocks of ``nn.ModuleList``s, e.g.
            ``transformer.h.0`` ... for GPT-2).
        plan_options: further ``make_plan`` options (e.g. ``bandwidth_bytes_per_s``).

    Returns:
        A :class:`~superneurons.memory.Plan` whose unit fqns are relative to ``model``; run it
        with ``apply_plan(model, plan)`` inside ``training_without_kv_cache(model)``.

    Raises:
        ConfigError: neither or both budgets, a fraction outside (0, 1], no loss in the output.
        InfeasibleBudgetError: the budget is below what any strategy reaches (named).
    """
    if (budget_bytes is None) == (budget_fraction is None):
        raise ConfigError("give exactly one of budget_bytes= or budget_fraction=")
    if budget_fraction is not None and not 0.0 < budget_fraction <= 1.0:
        raise ConfigError(f"budget_fraction must be in (0, 1], got {budget_fraction}")
    if not isinstance(batch, Mapping):
        raise ConfigError(f"batch must be a dict of model inputs, got {type(batch).__name__}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    step = _BatchLoss(model)
    chosen = units if units is not None else default_units(model)
    if not chosen:
        raise ConfigError("the model has no nn.ModuleList/nn.Sequential blocks: pass units=")
    profile = profile_step(
        step,
        dict(batch),
        None,
        _loss_is_output,
        _inner_optimizer(optimizer),
        units=[_PREFIX + fqn for fqn in chosen],
    )
    eager_bytes = profile.predicted_peak_bytes()
    if budget_bytes is None:
        assert budget_fraction is not None
        budget_bytes = max(1, int(budget_fraction * eager_bytes))
    plan_options.setdefault("allow_optimizer_in_backward", False)
    plan = make_plan(profile, budget_bytes=budget_bytes, strategy=strategy, **plan_options)
    logger.info(
        "plan for %s: eager peak %d B, budget %d B -> predicted %d B (%s: %d recompute, "
        "%d offload units)",
        type(model).__name__,
        eager_bytes,
        budget_bytes,
        plan.predicted_peak_bytes,
        plan.strategy,
        plan.count("recompute"),
        plan.count("offload"),
    )
    return _relative(plan)


@contextmanager
def training_without_kv_cache(model: nn.Module) -> Iterator[bool]:
    """Set ``model.config.use_cache = False`` inside the block; yields the previous value.

    A no-op for models without a ``config.use_cache`` (yields False).
    """
    config = getattr(model, "config", None)
    previous = bool(getattr(config, "use_cache", False))
    if previous:
        logger.info("use_cache=True would refill the key/value cache in recompute: set to False")
        config.use_cache = False  # type: ignore[union-attr]
    try:
        yield previous
    finally:
        if previous:
            config.use_cache = True  # type: ignore[union-attr]


def _loss_is_output(output: torch.Tensor, _targets: Any) -> torch.Tensor:
    return output


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (``.optimizer``)."""
    while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            raise ConfigError(f"not a torch optimizer: {type(optimizer).__name__}")
        optimizer = inner
    return optimizer


def _relative(plan: Plan) -> Plan:
    """The plan with the ``_BatchLoss`` wrapper's ``model.`` prefix taken off every fqn."""

    def strip(fqn: str) -> str:
        return fqn[len(_PREFIX) :] if fqn.startswith(_PREFIX) else fqn

    units = tuple(replace(u, fqn=strip(u.fqn)) for u in plan.units)
    tensors = tuple(replace(t, key=strip(t.key), unit=strip(t.unit)) for t in plan.tensors)
    return replace(plan, units=units, tensors=tensors)
