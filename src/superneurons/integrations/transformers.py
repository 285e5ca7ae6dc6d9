"""Hugging Face ``transformers.Trainer``: a memory plan and gradient compression as a callback.

::

    trainer = Trainer(model=model, args=TrainingArguments(..., ddp_backend="gloo"), ...)
    callback = SuperNeuronsCallback(trainer, compression="fft:theta=0.9,bits=8",
                                    budget_fraction=0.6)
    trainer.add_callback(callback)
    trainer.train()
    callback.setup.compression.bytes_sent_total  # what the hook put on the wire

Where the seam is (read from transformers 5.x ``Trainer._inner_training_loop``): the model is
wrapped in ``DistributedDataParallel`` by ``accelerator.prepare`` inside ``train()``, kept as
``trainer.model_wrapped``, and only then ``on_train_begin`` runs, before the first forward.
Callbacks are not handed the wrapped model, so this one holds the trainer. At
``on_train_begin`` it calls :func:`~superneurons.integrations.accelerate.prepare_superneurons`
on ``trainer.accelerator`` and ``trainer.model_wrapped``: the plan is profiled on one real
batch (``sample_batch``, by default the first ``per_device_train_batch_size`` examples of the
train set through the trainer's collator) and the comm hook is registered before the first
backward; then the ranks check they hold the same parameters and optimizer state
(:func:`~superneurons.replicas.check_replicas`). ``on_train_end`` restores the model's forwards,
``use_cache`` and HF's activation checkpointing. ``on_save`` writes each rank's compression
state (error-feedback residuals, step) into the checkpoint folder; resuming loads it back from
the folder given to ``train(resume_from_checkpoint=...)``, whatever ``output_dir`` is, read
weights-only (a file that would import anything but tensors and plain data is refused).

The profile is isolated (:mod:`superneurons.memory.profiling.isolate`): it runs the forward the
trainer runs (accelerate's autocast under ``bf16=True``; TRL's fused LM head for
``SFTTrainer``), in training mode, with the trainer's optimizer state, and leaves parameters,
gradients, optimizer, LR scheduler and random-number states (torch's and Python's) as they were,
so training is the same as without the callback. HF's own activation checkpointing
(``activation_checkpointing=True``, formerly ``gradient_checkpointing=True``, on by default in
TRL's ``SFTConfig``) recomputes every block; with a budget the plan takes recomputation over,
per block: HF's is off while the plan runs (one log line), and restored at ``on_train_end``.

The plan is made for the trainer's step: ``max_grad_norm`` and ``gradient_accumulation_steps``
are passed on. Where it steps the optimizer on the host (``strategy="offload+host-optimizer"``,
or ``auto`` on one process when nothing else fits), Trainer's own optimizer, LR scheduler and
weight-decay groups drive it, Trainer's clipping clips on the host and the ``grad_norm`` it logs
is the true global norm, micro-batches sum on the host (``no_sync`` under DDP, whose wrapper is
rebuilt in place), and a run stopped and resumed continues bitwise
(:mod:`superneurons.integrations.host_step`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from superneurons.errors import CheckpointError, ConfigError
from superneurons.integrations.accelerate import SuperNeuronsSetup, prepare_superneurons
from superneurons.integrations.hf import LossOf, model_loss
from superneurons.integrations.no_trace import no_trace
from superneurons.memory.profiling.isolate import unwrapped
from superneurons.randomness import python_random_kept
from superneurons.train.safeload import load_weights_only, refusal

__all__ = ["SuperNeuronsCallback"]

logger = logging.getLogger("superneurons.integrations")


def _leaves_no_trace(method: Callable[..., None]) -> Callable[..., None]:
    """``on_train_begin`` that, when it raises, leaves the trainer's model (its modules'
    forwards, hooks, HF checkpointing flags, ``use_cache``: :func:`no_trace`), the trainer's
    arguments and the callback's ``setup`` as they were before it ran."""

    @functools.wraps(method)
    def guarded(self: Any, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        previous, saved_args = self.setup, dict(vars(args))

        def undo() -> None:
            if self.setup is not None and self.setup is not previous:
                self.setup.remove()
            self.setup = previous
            vars(args).clear()
            vars(args).update(saved_args)

        wrapped = getattr(self.trainer, "model_wrapped", None)
        models = [unwrapped(wrapped)] if isinstance(wrapped, torch.nn.Module) else []
        with no_trace(*models, undo=undo):
            method(self, args, state, control, **kwargs)

    return guarded


class SuperNeuronsCallback(TrainerCallback):  # type: ignore[misc]
    """A ``TrainerCallback`` applying a memory plan and DDP gradient compression.

    Args:
        trainer: the ``transformers.Trainer`` it is added to.
        compression: a codec spec (``"fft:theta=0.9,bits=8"``, ``"torch-fp16"``, ...) or None.
        budget_bytes, budget_fraction: device-memory budget of a training step (bytes, or a
            fraction of the profiled eager peak); neither: no memory plan.
        sample_batch: the batch to profile (a dict of model inputs with labels); default: the
            first examples of ``trainer.train_dataset`` through ``trainer.data_collator``.
        strategy: the planner's strategy (``auto``).
        compression_options: ``register_compression`` options (``seed``, ``process_group``);
            error feedback and warm-up are wrappers in ``compression`` (``"ef(...)"``).

    Attributes:
        setup: the :class:`~superneurons.integrations.accelerate.SuperNeuronsSetup` installed at
            ``on_train_begin`` (compression counters, the plan), or None before.
    """

    def __init__(
        self,
        trainer: Any,
        *,
        compression: Any = None,
        budget_bytes: int | None = None,
        budget_fraction: float | None = None,
        sample_batch: Mapping[str, Any] | None = None,
        strategy: str = "auto",
        **compression_options: Any,
    ) -> None:
        if getattr(trainer, "accelerator", None) is None:
            raise ConfigError(
                "SuperNeuronsCallback needs a transformers.Trainer (with .accelerator)"
            )
        self.trainer = trainer
        self.compression = compression
        self.budget_bytes = budget_bytes
        self.budget_fraction = budget_fraction
        self.sample_batch = sample_batch
        self.strategy = strategy
        self.compression_options = compression_options
        self.setup: SuperNeuronsSetup | None = None
        self._hooked_model: Any = None

    @property
    def _wants_plan(self) -> bool:
        return self.budget_bytes is not None or self.budget_fraction is not None

    @_leaves_no_trace
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._wants_plan and getattr(args, "torch_compile", False):
            # refused before any work: the plan's runtime would refuse the first compiled step
            raise ConfigError(
                "TrainingArguments(torch_compile=True) compiles the model, and a memory plan's "
                "budget holds for the eager step it was profiled from: set torch_compile=False "
                "to train under the plan, or give SuperNeuronsCallback no budget "
                "(compression only)"
            )
        trainer = self.trainer
        batch = None
        device = torch.device(args.device)
        previous = self.setup
        # A second train() keeps the DDP model, which takes one comm hook: keep the first.
        hooked = previous is not None and previous.compression is not None
        hooked = hooked and trainer.model_wrapped is self._hooked_model
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), python_random_kept():
            if self._wants_plan:
                batch = _to_device(self.sample_batch or _first_batch(trainer), device)
            self.setup = prepare_superneurons(
                trainer.accelerator,
                trainer.model_wrapped,
                compression=None if hooked else self.compression,
                sample_batch=batch,
                budget_bytes=self.budget_bytes,
                budget_fraction=self.budget_fraction,
                optimizer=trainer.optimizer,
                strategy=self.strategy,
                loss_of=_loss_of(trainer),
                keep_outputs=False,  # Trainer.training_step keeps only the loss
                max_grad_norm=float(args.max_grad_norm or 0.0),  # what Trainer clips to
                gradient_accumulation_steps=args.gradient_accumulation_steps,
                **self.compression_options,
            )
        if hooked:  # its compression state goes on; a host optimizer is a new one
            assert previous is not None
            self.setup.compression = previous.compression
        if state.global_step > 0:
            self._resume(args, state, skip=("compression",) if hooked else ())
        self._hooked_model = trainer.model_wrapped

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Write this rank's compression state (error-feedback residuals, step, counters) and
        host optimizer state (fp32 masters, moments: Trainer's ``optimizer.pt`` then holds the
        hyperparameters only) into the checkpoint Trainer just wrote, next to its per-rank RNG
        state."""
        if self.setup is None:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        for kind, part in self._parts().items():
            path = _state_file(folder, args, kind)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(part.state_dict(), path)

    def _parts(self) -> dict[str, Any]:
        """What this callback saves per rank, by the name of its file."""
        assert self.setup is not None
        parts = {"compression": self.setup.compression, "host-optimizer": self.setup.host_optimizer}
        return {kind: part for kind, part in parts.items() if part is not None}

    def _resume(self, args: Any, state: Any, *, skip: tuple[str, ...] = ()) -> None:
        """Trainer resumed at ``state.global_step``: load what :meth:`on_save` wrote into the
        checkpoint folder ``train()`` was given (but the kinds in ``skip``)."""
        assert self.setup is not None
        parts = {k: v for k, v in self._parts().items() if k not in skip}
        if not parts:
            return
        folder = _resumed_from(self.trainer)
        if folder is None:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            logger.warning(
                "resumed at step %d, but the folder passed to train(resume_from_checkpoint=) "
                "was not found on the call stack; looking in %s",
                state.global_step,
                folder,
            )
        restarts = {
            "compression": "compression restarts its state (error-feedback residuals at zero)",
            "host-optimizer": "the host optimizer starts from the state the trainer's optimizer "
            "held (none after a run with the host optimizer)",
        }
        for kind, part in parts.items():
            path = _state_file(folder, args, kind)
            if not path.is_file():
                logger.warning(
                    "resumed at step %d but %s does not exist: %s",
                    state.global_step,
                    path,
                    restarts[kind],
                )
                continue
            part.load_state_dict(_read_state(path, restarts[kind]))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.setup is not None:
            self.setup.remove()


def _read_state(path: Path, without: str) -> Any:
    """One of :meth:`SuperNeuronsCallback.on_save`'s files, read weights-only: a file that
    would import anything but tensors and plain data is refused, unread (one line)."""
    try:
        return load_weights_only(path)
    except Exception as exc:
        why = refusal(exc)
        if why is None:
            raise
        raise CheckpointError(
            f"{path}: {why}; resume from a checkpoint folder you trust, or delete the file to "
            f"resume without it ({without})"
        ) from None


def _state_file(folder: Path, args: Any, kind: str) -> Path:
    """Where this rank's ``kind`` of state (``compression``, ``host-optimizer``) lives in one
    of Trainer's checkpoint folders."""
    return folder / f"superneurons-{kind}-rank{args.process_index}.pt"


def _resumed_from(trainer: Any) -> Path | None:
    """The checkpoint folder this ``train()`` call resumes from, or None.

    NOTE: transformers (4.x to 5.24) keeps it nowhere on the trainer or its state: it is the
    ``resume_from_checkpoint`` argument of ``Trainer._inner_training_loop`` (``True`` already
    resolved to the last checkpoint of ``output_dir`` by ``train()``), which calls
    ``on_train_begin``. So it is read from that frame, the trainer's own, on the call stack.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if (
                frame.f_code.co_name == "_inner_training_loop"
                and frame.f_locals.get("self") is trainer
            ):
                folder = frame.f_locals.get("resume_from_checkpoint")
                return Path(folder) if isinstance(folder, (str, Path)) else None
            frame = frame.f_back
        return None
    finally:
        del frame


def _loss_of(trainer: Any) -> LossOf:
    """The forward the trainer's ``compute_loss`` runs, for the profile to run the same.

    TRL's ``SFTTrainer`` (1.x) calls ``model(**inputs, use_cache=False, fused_lm_head=True)``
    (its LM head computes per-token log-probabilities in chunks, never the full logits);
    ``Trainer`` calls ``model(**inputs)``. ``compute_loss`` itself is not called: it logs
    metrics and gathers them across ranks (a collective only rank 0 would enter).
    """
    trl = sys.modules.get("trl")
    sft = getattr(trl, "SFTTrainer", None) if trl is not None else None
    if sft is not None and isinstance(trainer, sft):
        fused = trainer.compute_loss_func is None and trainer.label_smoother is None
        if fused:
            return _fused_lm_head_loss
    return model_loss


def _fused_lm_head_loss(model: Any, batch: Mapping[str, Any]) -> Any:
    """TRL's training forward (``SFTTrainer.compute_loss``)."""
    return model(**{**batch, "use_cache": False}, fused_lm_head=True)


def _first_batch(trainer: Any) -> Mapping[str, Any]:
    """The first ``per_device_train_batch_size`` training examples, collated as Trainer does."""
    dataset = trainer.train_dataset
    size = int(trainer.args.per_device_train_batch_size)
    try:
        examples = [dataset[i] for i in range(min(size, len(dataset)))]
    except TypeError:
        raise ConfigError(
            "the train dataset has no len()/indexing (an IterableDataset?): pass sample_batch="
        ) from None
    batch = trainer.data_collator(examples)
    if not isinstance(batch, Mapping):
        raise ConfigError("the data collator does not return a dict: pass sample_batch=")
    return batch


def _to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
