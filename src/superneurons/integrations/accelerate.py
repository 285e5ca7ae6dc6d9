"""Hugging Face Accelerate: both halves after ``accelerator.prepare``.

::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    setup = prepare_superneurons(
        accelerator, model, compression="fft:theta=0.9,bits=8",
        sample_batch=next(iter(loader)), budget_fraction=0.6, optimizer=optimizer,
    )
    ...  # the ordinary loop: accelerator.backward(model(**batch).loss), optimizer.step()
    setup.remove()

``prepare`` wraps the model in ``DistributedDataParallel`` (multi-process CPU or GPU). Before
the first backward, :func:`prepare_superneurons`

1. plans memory (:func:`~superneurons.integrations.hf.plan_for_batch`: one profiled step of
   ``model(**batch).loss``, isolated so that nothing of the training state changes,
   SuperNeurons' keep / offload / recompute per block, Wang et al. PPoPP'18) on rank 0 and
   broadcasts the plan, so every rank runs the same one (measured step times differ across
   ranks, and so could cost-aware choices), then applies it to the unwrapped model with
   ``use_cache`` and HF's own activation checkpointing off (both restored by ``remove()``);
2. registers gradient compression on the DDP model
   (:func:`~superneurons.compress.register_compression`, Wang et al. HPDC'20 and the baselines;
   a collective that checks every rank is configured alike);
3. checks that every rank holds the same parameters, buffers and optimizer state
   (:func:`~superneurons.replicas.check_replicas`, one all-gather of fingerprints), so a setup
   that changed one rank fails here, naming the tensor, instead of training diverged replicas.

Accelerate's own ``DistributedDataParallelKwargs(comm_hook=...)`` registers a PyTorch hook at
``prepare``; a DDP model takes one hook only, so combining both is refused. FSDP and DeepSpeed
do their own gradient reduction: compression is refused there too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from superneurons.compress import CompressionState, register_compression
from superneurons.errors import ConfigError
from superneurons.integrations.hf import (
    LossOf,
    hf_checkpointing_off,
    model_loss,
    plan_for_batch,
    training_without_kv_cache,
)
from superneurons.integrations.host_step import (
    HOST_OPTIMIZER,
    host_reserved_bytes,
    install_host_step,
    training_step_of,
)
from superneurons.integrations.no_trace import no_trace
from superneurons.memory import Plan, PlanHandle, apply_plan
from superneurons.memory.offload.handover import factory_like
from superneurons.memory.offload.host_optimizer import HostOptimizerView
from superneurons.memory.profiling.isolate import unwrapped
from superneurons.memory.runtime.ranks import planned_on_rank_zero
from superneurons.replicas import check_replicas

__all__ = ["SuperNeuronsSetup", "ddp_reserved_bytes", "prepare_superneurons"]

logger = logging.getLogger("superneurons.integrations")


class SuperNeuronsSetup:
    """What :func:`prepare_superneurons` installed; :meth:`remove` undoes the memory plan.

    Attributes:
        compression: the comm hook's state (counters such as ``bytes_sent_total`` and
            ``dense_bytes_step``, ``state_dict()`` for checkpoints), or None.
        plan: the memory plan every rank runs (fqns relative to the unwrapped model), or None.
        plan_handle: the applied plan (pool and recompute statistics), or None.
        reserved_bytes: what DDP holds beside the planned step (:func:`ddp_reserved_bytes`);
            the budget is ``plan.budget_bytes + reserved_bytes``.
    """

    def __init__(self) -> None:
        self.compression: CompressionState | None = None
        self.plan: Plan | None = None
        self.plan_handle: PlanHandle | None = None
        self.reserved_bytes = 0
        self._undo = ExitStack()

    def remove(self) -> None:
        """Restore the model's forwards and ``use_cache`` (the comm hook stays: DDP has no way
        to unregister one). Idempotent."""
        self._undo.close()

    @property
    def host_optimizer(self) -> HostOptimizerView | None:
        """The host optimizer a plan with ``host_optimizer`` steps (None otherwise)."""
        return self.plan_handle.optimizer if self.plan_handle is not None else None

    def state_dict(self) -> dict[str, Any]:
        """The compression state (error-feedback residuals, step), the plan and the host
        optimizer's state (fp32 masters, moments; None without one), for checkpoints
        (``accelerator.register_for_checkpointing(setup)``)."""
        host = self.host_optimizer
        return {
            "compression": self.compression.state_dict() if self.compression else None,
            "plan": self.plan.to_dict() if self.plan else None,
            "host_optimizer": host.state_dict() if host is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (the plan stays the one applied)."""
        if state.get("compression") is not None and self.compression is not None:
            self.compression.load_state_dict(state["compression"])
        saved_host = state.get("host_optimizer")
        host = self.host_optimizer
        if (saved_host is None) != (host is None):
            raise ConfigError(
                "the saved state and this setup differ in whether the optimizer steps on the "
                "host: resume with the budget and strategy the checkpoint was written with"
            )
        if host is not None and saved_host is not None:
            host.load_state_dict(saved_host)


def prepare_superneurons(
    accelerator: Any,
    model: nn.Module,
    *,
    compression: Any = None,
    sample_batch: Mapping[str, Any] | None = None,
    budget_bytes: int | None = None,
    budget_fraction: float | None = None,
    optimizer: Any = None,
    strategy: str = "auto",
    loss_of: LossOf = model_loss,
    keep_outputs: bool = True,
    max_grad_norm: float = 0.0,
    gradient_accumulation_steps: int | None = None,
    **compression_options: Any,
) -> SuperNeuronsSetup:
    """Apply a memory plan and gradient compression to a model ``accelerator.prepare`` returned.

    Collective when the run has several processes: every rank calls it, before the first
    backward.

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: the prepared model (``DistributedDataParallel`` with several processes).
        compression: a codec spec (``"fft:theta=0.9,bits=8"``, ``"topk:ratio=0.01"``,
            ``"torch-fp16"``) or codec object; None: no compression.
        sample_batch: one real training batch (with labels) to profile; with a budget.
        budget_bytes, budget_fraction: the device-memory budget (see
            :func:`~superneurons.integrations.hf.plan_for_batch`); neither: no memory plan.
            Under DDP it includes DDP's gradient buckets (:func:`ddp_reserved_bytes`), which
            the plan leaves room for.
        optimizer: the (prepared) optimizer, so its state counts in the profiled peak; when
            the plan steps the optimizer on the host (``offload+host-optimizer``; under DDP
            when asked for by name), the loop keeps stepping it and the host optimizer does the
            work (:mod:`superneurons.integrations.host_step`; its state:
            ``setup.state_dict()``).
        strategy: the planner's strategy (``auto`` by default).
        loss_of: how the training loop gets the loss, ``loss_of(model, batch)`` (default
            ``model(**batch)``), so the profile runs the forward training will call.
        keep_outputs: the loop may keep the whole output (the logits) through backward, as
            accelerate's ``no_trainer`` examples do (default: counted, so the budget holds);
            ``False`` for a loop that keeps only the loss (HF's ``Trainer``).
        max_grad_norm: the loop clips gradients to this global norm
            (``accelerator.clip_grad_norm_``); 0: it does not. The plan is made for it.
        gradient_accumulation_steps: micro-batches per optimizer step (default: the
            accelerator's; Trainer keeps its own and passes it). The plan counts the sums.
        compression_options: ``register_compression`` options (``seed``, ``process_group``);
            error feedback, warm-up and θ schedules are wrappers in ``compression`` itself
            (``"ef(warmup(steps=100,topk:ratio=0.01))"``).

    Raises:
        ConfigError: compression without DDP (FSDP, DeepSpeed) or besides accelerate's own
            comm hook; a budget without ``sample_batch``; and the errors of the two verbs.
        ReplicaMismatchError: the ranks' parameters or optimizer state differ after setup.
    """
    budget_given = budget_bytes is not None or budget_fraction is not None
    if budget_given and sample_batch is None:
        raise ConfigError("a memory budget needs sample_batch=: one real batch to profile")
    ddp = _find_ddp(model)
    if compression is not None:
        _check_can_compress(accelerator, ddp)
    setup = SuperNeuronsSetup()
    with no_trace(model, undo=setup.remove):  # a set-up that fails leaves the model as it was
        if budget_given:
            budget = dict(
                budget_bytes=budget_bytes,
                budget_fraction=budget_fraction,
                strategy=strategy,
                loss_of=loss_of,
                keep_outputs=keep_outputs,
                step=training_step_of(accelerator, max_grad_norm, gradient_accumulation_steps),
            )
            _apply_memory_plan(
                setup, accelerator, model, ddp, sample_batch or {}, optimizer, budget
            )
        if ddp is not None:  # replicas: the same state on every rank, or an error naming a tensor
            optimizers = [optimizer] if optimizer is not None else []
            check_replicas(ddp, optimizers=optimizers, process_group=ddp.process_group)
        if compression is not None and ddp is not None:  # last: DDP cannot unregister a hook
            setup.compression = register_compression(ddp, compression, **compression_options)
    return setup


def _apply_memory_plan(
    setup: SuperNeuronsSetup,
    accelerator: Any,
    model: nn.Module,
    ddp: DistributedDataParallel | None,
    batch: Mapping[str, Any],
    optimizer: Any,
    budget: dict[str, Any],
) -> None:
    """Plan the step of one sample batch on rank 0 (:func:`plan_for_batch` with the caller's
    ``budget`` options) and apply it to the unwrapped model, every change entered in
    ``setup``'s undo stack: HF's own checkpointing off, the KV cache off, the plan's hooks and,
    for a host-optimizer plan, the loop's optimizer handed over."""
    inner = unwrapped(model)
    turned_off = setup._undo.enter_context(hf_checkpointing_off(inner))
    if turned_off:
        logger.info(
            "%s had HF activation checkpointing on in %d modules (TRL's SFTConfig turns "
            "gradient_checkpointing on by default): off while the memory plan runs, which "
            "recomputes per block where the budget needs it; setup.remove() restores it",
            type(inner).__name__,
            turned_off,
        )
    host = budget["strategy"] == HOST_OPTIMIZER  # under DDP, the host optimizer by name only
    if ddp is not None:  # DDP's buckets, or those of its one parameter once rebuilt
        setup.reserved_bytes = host_reserved_bytes(ddp) if host else ddp_reserved_bytes(ddp)
    setup.plan = planned_on_rank_zero(
        lambda: plan_for_batch(
            inner,
            batch,
            optimizer=optimizer,
            reserved_bytes=setup.reserved_bytes,
            # NOTE: DDP holds its gradient buckets until the host optimizer's plan rebuilds it
            # (host_step): ``auto`` plans for DDP as it is
            allow_host_optimizer=ddp is None or host,
            **budget,
        )
    )
    setup._undo.enter_context(training_without_kv_cache(inner))
    factory = None
    if setup.plan.host_optimizer:
        if optimizer is None:
            raise ConfigError(
                "the plan steps the optimizer on the host (offload+host-optimizer): pass "
                "optimizer=, the optimizer the loop steps"
            )
        factory = factory_like(optimizer, inner)
    setup.plan_handle = setup._undo.enter_context(
        apply_plan(inner, setup.plan, optimizer_factory=factory)
    )
    if setup.plan.host_optimizer:
        install_host_step(setup._undo, accelerator, ddp, setup.plan_handle, optimizer)
        logger.info(
            "the optimizer steps on the host, bucket by bucket (in backward, or at the loop's "
            "optimizer.step() where it clips or accumulates); its state is "
            "setup.state_dict()['host_optimizer']"
        )


def ddp_reserved_bytes(ddp: DistributedDataParallel) -> int:
    """Device bytes DDP holds beside the step a profile runs (a profile never runs DDP).

    Its gradient buckets hold one copy of every gradient for the whole run, and unless
    ``gradient_as_bucket_view=True`` each step allocates one more: measured with the
    live-storage tracker on 2 gloo ranks (8 ``Linear(256, 256)``, SGD), a DDP step allocates
    2.00x the gradient bytes where the same step without DDP allocates 1.00x (1.14x with
    ``gradient_as_bucket_view=True``, whose gradients are the buckets). Compression hooks'
    own buffers (error-feedback residuals) are not included.
    """
    grads = sum(p.numel() * p.element_size() for p in ddp.module.parameters() if p.requires_grad)
    return grads if ddp.gradient_as_bucket_view else 2 * grads


def _find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The DDP module inside ``model`` (it may sit under ``torch.compile``'s wrapper)."""
    while not isinstance(model, DistributedDataParallel):
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return None
        model = inner
    return model


def _check_can_compress(accelerator: Any, ddp: DistributedDataParallel | None) -> None:
    kind = str(getattr(accelerator, "distributed_type", "")).rsplit(".", 1)[-1].upper()
    if kind in ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"):
        raise ConfigError(
            f"gradient compression hooks into DDP; accelerate is running {kind}, which reduces "
            "gradients itself: use multi-process DDP (the default of `accelerate launch`)"
        )
    if ddp is None:
        if getattr(accelerator, "num_processes", 1) > 1:
            raise ConfigError(
                "the model is not DistributedDataParallel: pass the model accelerator.prepare "
                "returned"
            )
        logger.info("one process: no gradients to average, compression is not installed")
        return
    handler = getattr(accelerator, "ddp_handler", None)
    hook = getattr(handler, "comm_hook", None)
    if hook is not None and str(getattr(hook, "value", hook)).lower() != "no":
        raise ConfigError(
            f"accelerate already registered DDP comm hook {hook}; a DDP model takes one hook: "
            "drop comm_hook from DistributedDataParallelKwargs, or pass compression='torch-fp16'"
        )
