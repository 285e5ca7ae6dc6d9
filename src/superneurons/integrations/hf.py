"""Memory plans for models trained on a batch dict: ``loss = model(**batch).loss`` (HF style).

Hugging Face models (and the loops of ``transformers.Trainer`` and ``accelerate``) call the
model with keyword arguments and read the loss from its output. :func:`plan_for_batch` runs
SuperNeurons' three verbs on such a model (Wang et al., PPoPP'18; ``superneurons.memory``):
profile one real step on ``batch`` in training mode (isolated,
:mod:`superneurons.memory.profiling.isolate`: the model's own forward runs, patches and autocast
wrappers included, while its parameters, gradients, buffers, the optimizer and the RNG are
untouched), plan keep / offload / recompute per transformer block under a byte budget, and
return the plan with unit fqns relative to the model, ready for ``apply_plan(model, plan)``.

Three things HF models need that plain modules do not:

* **The key/value cache.** With ``config.use_cache=True`` (GPT-2's default) a training forward
  also fills a ``DynamicCache``; a recomputed block appends its keys and values a second time
  (on CUDA this crashed with 2048 vs 1024 positions, and on CPU it exceeded the budget).
  Measured here in one run (GPT-2, 6 layers, width 256, batch 8 x 256, AdamW, recompute
  plans): without the cache the measured step peak equals the plan's prediction to the byte;
  with it, the peak exceeds the prediction by 8.6% at a 70% budget and 19% at 50% (the budget
  itself by 4%). :func:`training_without_kv_cache` sets ``use_cache=False`` while training, as
  HF does itself under gradient checkpointing (transformers 5's ``Trainer`` already sets
  ``config.use_cache = args.use_cache``, False by default; plain loops keep the config's).
* **HF's own activation checkpointing** (``activation_checkpointing=True``, formerly
  ``gradient_checkpointing``; TRL's ``SFTConfig`` turns it on by default) recomputes every
  block, so a profile sees no activations to plan: :func:`hf_checkpointing_off` turns it off
  while a plan runs (the plan recomputes per block, where the budget needs it).
* **No optimizer-in-backward.** These models train under DDP here, where stepping a parameter
  inside backward would step it before its gradient is averaged: plans never choose it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory import (
    InfeasibleBudgetError,
    Plan,
    Profile,
    default_units,
    make_plan,
    min_peak_bytes,
    profile_step,
)
from superneurons.memory.fsdp import agree_plan, is_fully_sharded
from superneurons.memory.profiling.isolate import unwrapped
from superneurons.memory.profiling.step import output_loss

__all__ = [
    "LossOf",
    "hf_checkpointing_off",
    "model_loss",
    "plan_for_batch",
    "training_without_kv_cache",
]

logger = logging.getLogger("superneurons.integrations")

_PREFIX = "model."

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


def _data_parallel() -> bool:
    """A process group of several ranks is running (the plan must suit DDP)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def plan_for_batch(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    budget_bytes: int | None = None,
    budget_fraction: float | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    strategy: str = "auto",
    units: list[str] | None = None,
    loss_of: LossOf = model_loss,
    reserved_bytes: int = 0,
    keep_outputs: bool = False,
    autocast: torch.dtype | None = None,
    **plan_options: Any,
) -> Plan:
    """Profile one step of ``model(**batch).loss`` and plan it under a device-memory budget.

    Args:
        model: the model, e.g. a ``transformers.PreTrainedModel`` (a DDP or ``torch.compile``
            wrapper is taken off; the model's own ``forward``, patched or not, is what runs).
        batch: one real training batch, on the model's device, with the labels.
        budget_bytes: the device byte budget for one training step; or
        budget_fraction: the budget as a fraction in (0, 1] of the profiled eager peak.
        optimizer: the optimizer the trainer steps (accelerate's wrapper is fine), so its
            state counts in the peak (optional); a shadow of it steps, never it.
        strategy: as for :func:`superneurons.memory.make_plan` (``auto`` by default; on a CPU
            device ``auto`` means ``recompute``: there the host pool is the same memory).
        units: module fqns a plan decides for (default: the blocks of ``nn.ModuleList``s, e.g.
            ``transformer.h.0`` ... for GPT-2).
        loss_of: how the trainer computes the loss, ``loss_of(model, batch)`` (default
            ``model(**batch)``, its ``loss``): profile the forward the trainer really calls.
        reserved_bytes: device bytes the step holds besides what the profile sees (DDP's
            gradient buckets): part of the eager peak a fraction refers to, and left out of
            the budget the plan gets (``plan.budget_bytes`` is the budget minus them).
        keep_outputs: the loop keeps the model's whole output (the logits) alive through
            backward and the optimizer step, until the next step reassigns it: HF's
            ``no_trainer`` examples (``outputs = model(**batch); loss = outputs.loss``).
            ``False`` (default): only the loss is kept, as HF's ``Trainer`` does.
        autocast: the loop runs forward and loss under ``torch.autocast(device, dtype=...)``
            and backward and the step outside it (PyTorch's AMP recipe); also read from an
            enabled autocast block around this call.
        plan_options: further ``make_plan`` options (e.g. ``bandwidth_bytes_per_s``).

    Returns:
        A :class:`~superneurons.memory.Plan` whose unit fqns are relative to ``model``; run it
        with ``apply_plan(model, plan)`` inside ``training_without_kv_cache(model)``. For a
        ``fully_shard`` (FSDP2) model, called on every rank of the initialised process group:
        each rank profiles its own shards, and every rank gets rank 0's plan
        (:func:`superneurons.memory.fsdp.agree_plan`).

    Raises:
        ConfigError: neither or both budgets, a fraction outside (0, 1], no loss in the output,
            a step in which none of the units ran or saved anything (named with the cause).
        InfeasibleBudgetError: the budget is below what any strategy reaches (named).
        ConfigError: (FSDP2) a strategy other than ``recompute``/``auto``, or another rank
            failed to plan, or planned other units.
    """
    model = unwrapped(model)
    _check_request(model, batch, budget_bytes, budget_fraction, strategy)
    chosen = units if units is not None else default_units(model)
    if not chosen:
        raise ConfigError("the model has no nn.ModuleList/nn.Sequential blocks: pass units=")
    profile = _profile_batch(model, batch, optimizer, chosen, loss_of, keep_outputs, autocast)
    eager_bytes = profile.predicted_peak_bytes() + reserved_bytes
    if budget_bytes is None:
        assert budget_fraction is not None
        budget_bytes = max(1, int(budget_fraction * eager_bytes))
    if budget_bytes <= reserved_bytes:
        raise ConfigError(
            f"a budget of {budget_bytes} B leaves nothing for the step beside the "
            f"{reserved_bytes} B reserved (DDP's gradient buckets): raise the budget"
        )
    plan_options.setdefault("allow_optimizer_in_backward", False)
    # streamed weights are one device's: under data parallelism FSDP2 shards them instead
    plan_options.setdefault("allow_weight_streaming", not _data_parallel())
    plan = _agreed_plan(
        model, profile, budget_bytes - reserved_bytes, strategy, plan_options, reserved_bytes
    )
    logger.info(
        "plan for %s: eager peak %d B (%d B of it reserved), budget %d B -> predicted %d B "
        "(%s: %d recompute, %d offload units)",
        type(model).__name__,
        eager_bytes,
        reserved_bytes,
        budget_bytes,
        plan.predicted_peak_bytes + reserved_bytes,
        plan.strategy,
        plan.count("recompute"),
        plan.count("offload"),
    )
    return _relative(plan)


def _profile_batch(
    model: nn.Module,
    batch: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None,
    units: list[str],
    loss_of: LossOf,
    keep_outputs: bool,
    autocast: torch.dtype | None,
) -> Profile:
    """One step of the trainer's own forward (``loss_of``) in training mode, profiled per
    unit; checked to have run and saved in the units."""
    step = _BatchLoss(model, loss_of, whole_output=keep_outputs)
    with _training_mode(model):  # trainers call model.train() before every step
        profile = profile_step(
            step,
            dict(batch),
            None,
            output_loss if keep_outputs else _loss_is_output,
            optimizer,
            units=[_PREFIX + fqn for fqn in units],
            keep_output=True,
            carry_output=keep_outputs,
            autocast=autocast,
        )
    _check_observed(profile, model, units)
    return profile


def _check_request(
    model: nn.Module,
    batch: Any,
    budget_bytes: int | None,
    budget_fraction: float | None,
    strategy: str,
) -> None:
    """One budget, a fraction in (0, 1], a dict batch, and a strategy FSDP2 can run."""
    if (budget_bytes is None) == (budget_fraction is None):
        raise ConfigError("give exactly one of budget_bytes= or budget_fraction=")
    if budget_fraction is not None and not 0.0 < budget_fraction <= 1.0:
        raise ConfigError(f"budget_fraction must be in (0, 1], got {budget_fraction}")
    if not isinstance(batch, Mapping):
        raise ConfigError(f"batch must be a dict of model inputs, got {type(batch).__name__}")
    if is_fully_sharded(model) and strategy not in ("auto", "recompute", "eager", "checkpoint"):
        raise ConfigError(
            f"strategy {strategy!r} on a fully_shard (FSDP2) model: use 'recompute' (or 'auto'); "
            "FSDP2 already shards parameters, gradients and optimizer state"
        )


def _agreed_plan(
    model: nn.Module,
    profile: Profile,
    budget_bytes: int,
    strategy: str,
    plan_options: dict[str, Any],
    reserved_bytes: int,
) -> Plan:
    """The plan for the step's own budget (the reserved bytes taken off); on a CPU device and
    for a fully_shard model ``auto`` is ``recompute``. A fully_shard model's ranks all get rank
    0's plan, and all raise where one failed."""
    first = next(iter(model.parameters()), None)
    sharded = is_fully_sharded(model)
    if strategy == "auto" and (sharded or (first is not None and first.device.type == "cpu")):
        # NOTE: on a CPU device the host pool is the same memory: offloading frees nothing;
        # a fully_shard model runs keep/recompute plans (memory.fsdp)
        strategy = "recompute"
    plan: Plan | None = None
    error: BaseException | None = None
    try:
        plan = _plan(profile, budget_bytes, strategy, plan_options)
    except InfeasibleBudgetError as exc:
        # a sharded model runs recompute plans only: report their floor, not offload's
        error = _recompute_floor_error(profile, budget_bytes, reserved_bytes) if sharded else exc
    except ConfigError as exc:
        error = exc
    if sharded:  # every rank runs rank 0's plan; a rank that failed makes every rank raise
        plan = agree_plan(plan, error=error)
    elif error is not None:
        raise error
    assert plan is not None
    return plan


def _plan(profile: Profile, budget_bytes: int, strategy: str, options: dict[str, Any]) -> Plan:
    try:
        return make_plan(profile, budget_bytes=budget_bytes, strategy=strategy, **options)
    except InfeasibleBudgetError as exc:
        if any(s.unit for s in profile.saved if s.nbytes > 0):
            raise
        raise ConfigError(
            f"{exc}; but no unit saved any activation in the profiled step, so no plan can "
            "lower the peak: is the model's own activation checkpointing on inside its forward? "
            "(HF's is turned off by prepare_superneurons and the HF callback)"
        ) from exc


def _recompute_floor_error(
    profile: Profile, budget_bytes: int, reserved_bytes: int
) -> InfeasibleBudgetError:
    floor = min_peak_bytes(profile)["recompute"] + reserved_bytes
    return InfeasibleBudgetError(
        f"budget {budget_bytes + reserved_bytes} B is below the smallest predicted peak of a "
        f"recompute plan on this fully_shard (FSDP2) model, {floor} B per rank: raise the "
        "budget to at least that, shard over more ranks, or shrink the batch",
        min_budget_bytes=floor,
        strategy="recompute",
    )


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


@contextmanager
def hf_checkpointing_off(model: nn.Module) -> Iterator[int]:
    """Turn HF's activation checkpointing off inside the block; yields how many modules had it.

    HF models mark each checkpointed module with ``gradient_checkpointing = True``
    (``PreTrainedModel._set_gradient_checkpointing``, transformers 4.35 to 5.x); the flags are
    set to False and restored on exit, so the model's own configuration comes back as it was.
    """
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for module in flagged:
        setattr(module, "gradient_checkpointing", False)  # noqa: B010 - any module type
    try:
        yield len(flagged)
    finally:
        for module in flagged:
            setattr(module, "gradient_checkpointing", True)  # noqa: B010


def _relative(plan: Plan) -> Plan:
    """The plan with the ``_BatchLoss`` wrapper's ``model.`` prefix taken off every fqn."""

    def strip(fqn: str) -> str:
        return fqn[len(_PREFIX) :] if fqn.startswith(_PREFIX) else fqn

    units = tuple(replace(u, fqn=strip(u.fqn)) for u in plan.units)
    tensors = tuple(replace(t, key=strip(t.key), unit=strip(t.unit)) for t in plan.tensors)
    head = None if plan.head is None else replace(plan.head, fqn=strip(plan.head.fqn))
    return replace(
        plan,
        units=units,
        tensors=tensors,
        head=head,
        seq_chunks=tuple(replace(c, fqn=strip(c.fqn)) for c in plan.seq_chunks),
        grad_buckets=tuple(tuple(strip(f) for f in bucket) for bucket in plan.grad_buckets),
    )
