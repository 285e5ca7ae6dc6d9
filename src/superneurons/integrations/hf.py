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
from superneurons.integrations.batch_step import PREFIX, BatchStep, LossOf, model_loss
from superneurons.memory import (
    InfeasibleBudgetError,
    Plan,
    Profile,
    default_units,
    make_plan,
    min_peak_bytes,
)
from superneurons.memory.fsdp import agree_plan, is_fully_sharded
from superneurons.memory.profiling.isolate import unwrapped

__all__ = [
    "LossOf",
    "hf_checkpointing_off",
    "model_loss",
    "plan_for_batch",
    "training_without_kv_cache",
]

logger = logging.getLogger("superneurons.integrations")


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
    keep_outputs: bool = True,
    autocast: torch.dtype | None = None,
    below: bool = True,
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
        keep_outputs: ``True`` (default): the loop may keep the whole output (the logits)
            through backward and the step, as HF's ``no_trainer`` examples do (``outputs =
            model(**batch)``); counted, so the budget holds for such a loop. ``False``: it
            keeps only the loss (HF's ``Trainer``, TRL): a lower peak where logits exist.
        autocast: the loop runs forward and loss under ``torch.autocast(device, dtype=...)``
            and backward and the step outside it (PyTorch's AMP recipe); also read from an
            enabled autocast block around this call.
        below: where the plain step does not fit, profile it below its largest layer too (a
            causal LM's head + loss in chunks, inside PEFT's wrappers and TRL's fused head
            too; MLPs over the sequence: :mod:`.batch_step`). ``False``: the step as it is.
        plan_options: further ``make_plan`` options (e.g. ``bandwidth_bytes_per_s``).

    Returns:
        A :class:`~superneurons.memory.Plan` whose unit fqns are relative to ``model``; run it
        with ``apply_plan(model, plan)`` inside ``training_without_kv_cache(model)``. Its
        ``budget_bytes``, ``predicted_peak_bytes`` and ``min_budget_bytes`` leave out
        ``reserved_bytes`` (add them back to compare with the budget given). For a
        ``fully_shard`` (FSDP2) model, called on every rank of the initialised process group:
        each rank profiles its own shards, and every rank gets rank 0's plan
        (:func:`superneurons.memory.fsdp.agree_plan`).

    Raises:
        ConfigError: neither or both budgets, a fraction outside (0, 1], no loss in the output,
            a step in which none of the units ran or saved anything (named with the cause).
        InfeasibleBudgetError: the budget is below what the strategy reaches on this device
            (``auto`` on a CPU device: ``recompute``), below the largest layer included; its
            ``min_budget_bytes`` (``reserved_bytes`` included) is a ``budget_bytes`` this call
            plans at.
        ConfigError: (FSDP2) a strategy other than ``recompute``/``auto``, or another rank
            failed to plan, or planned other units.
    """
    model = unwrapped(model)
    _check_request(model, batch, budget_bytes, budget_fraction, strategy)
    chosen = units if units is not None else default_units(model)
    if not chosen:
        raise ConfigError("the model has no nn.ModuleList/nn.Sequential blocks: pass units=")
    step = BatchStep(model, batch, optimizer, chosen, loss_of, keep_outputs, autocast)
    profile = step.profile()
    eager_bytes = profile.predicted_peak_bytes() + reserved_bytes
    budget_bytes = _step_budget(eager_bytes, budget_bytes, budget_fraction, reserved_bytes)
    plan_options.setdefault("allow_optimizer_in_backward", False)
    # streamed weights are one device's: under data parallelism FSDP2 shards them instead
    plan_options.setdefault("allow_weight_streaming", not _data_parallel())
    plan = _agreed_plan(
        model,
        profile,
        budget_bytes - reserved_bytes,
        strategy,
        plan_options,
        reserved_bytes,
        below=step.below if below else None,
    )
    _log_plan(model, plan, eager_bytes, reserved_bytes, budget_bytes)
    return _relative(plan)


def _log_plan(
    model: nn.Module, plan: Plan, eager_bytes: int, reserved_bytes: int, budget_bytes: int
) -> None:
    logger.info(
        "plan for %s: eager peak %d B (%d B of it reserved), budget %d B -> predicted %d B "
        "(%s: %d recompute, %d offload units, head %s)",
        type(model).__name__,
        eager_bytes,
        reserved_bytes,
        budget_bytes,
        plan.predicted_peak_bytes + reserved_bytes,
        plan.strategy,
        plan.count("recompute"),
        plan.count("offload"),
        "in chunks" if plan.head is not None else "as shipped",
    )


def _step_budget(
    eager_bytes: int, budget_bytes: int | None, budget_fraction: float | None, reserved_bytes: int
) -> int:
    """The budget in bytes (a fraction of the eager peak, reserved bytes included), checked to
    leave room for the step beside the reserved bytes."""
    if budget_bytes is None:
        assert budget_fraction is not None
        budget_bytes = max(1, int(budget_fraction * eager_bytes))
    if budget_bytes <= reserved_bytes:
        raise ConfigError(
            f"a budget of {budget_bytes} B leaves nothing for the step beside the "
            f"{reserved_bytes} B reserved (DDP's gradient buckets): raise the budget"
        )
    return budget_bytes


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
    *,
    below: Callable[[Profile], list[Profile]] | None = None,
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
        # NOTE: below the largest layer on one device only: the sharded runtime (memory.fsdp)
        # runs keep/recompute units
        plan = _plan(profile, budget_bytes, strategy, plan_options, None if sharded else below)
    except InfeasibleBudgetError as exc:
        # a sharded model runs recompute plans only: report their floor, not offload's
        error = (
            _recompute_floor_error(profile, budget_bytes, reserved_bytes)
            if sharded
            else _with_reserved(exc, reserved_bytes)
        )
    except ConfigError as exc:
        error = exc
    if sharded:  # every rank runs rank 0's plan; a rank that failed makes every rank raise
        plan = agree_plan(plan, error=error)
    elif error is not None:
        raise error
    assert plan is not None
    return plan


def _plan(
    profile: Profile,
    budget_bytes: int,
    strategy: str,
    options: dict[str, Any],
    below: Callable[[Profile], list[Profile]] | None,
) -> Plan:
    """The plan of the plain step; where that does not fit, of the step below its largest
    layer (``below(profile)``, profiled only then: chunks are used where the budget needs
    them, and a fitting plan costs one profile)."""
    try:
        return make_plan(profile, budget_bytes=budget_bytes, strategy=strategy, **options)
    except InfeasibleBudgetError as exc:
        chunked = below(profile) if below is not None else []
        if chunked:
            return make_plan(
                profile, budget_bytes=budget_bytes, strategy=strategy, chunked=chunked, **options
            )
        if any(s.unit for s in profile.saved if s.nbytes > 0):
            raise
        raise ConfigError(
            f"{exc}; but no unit saved any activation in the profiled step, so no plan can "
            "lower the peak: is the model's own activation checkpointing on inside its forward? "
            "(HF's is turned off by prepare_superneurons and the HF callback)"
        ) from exc


def _with_reserved(error: InfeasibleBudgetError, reserved_bytes: int) -> InfeasibleBudgetError:
    """``error`` naming the budget the caller passes: the step's minimum plus what DDP
    reserves beside it."""
    if reserved_bytes == 0:
        return error
    floor = error.min_budget_bytes + reserved_bytes
    return InfeasibleBudgetError(
        f"{error}; with the {reserved_bytes} B DDP holds beside the step, pass a budget of at "
        f"least {floor} B",
        min_budget_bytes=floor,
        strategy=error.strategy,
    )


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
        return fqn[len(PREFIX) :] if fqn.startswith(PREFIX) else fqn

    units = tuple(replace(u, fqn=strip(u.fqn)) for u in plan.units)
    tensors = tuple(replace(t, key=strip(t.key), unit=strip(t.unit)) for t in plan.tensors)
    head = None if plan.head is None else replace(plan.head, fqn=strip(plan.head.fqn))
    return replace(
        plan,
        units=units,
        tensors=tensors,
        head=head,
        seq_chunks=tuple(replace(c, fqn=strip(c.fqn)) for c in plan.seq_chunks),
        adapter_inputs=tuple(strip(f) for f in plan.adapter_inputs),
        grad_buckets=tuple(tuple(strip(f) for f in bucket) for bucket in plan.grad_buckets),
    )
