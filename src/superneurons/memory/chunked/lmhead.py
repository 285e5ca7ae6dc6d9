"""Run a causal LM's head + loss in chunks (:mod:`.headloss`) on the model as shipped.

A plan with :class:`~superneurons.memory.plan.HeadChunking` replaces two ``forward``
attributes (instance attributes, restored exactly by :func:`chunk_head`'s handle): the model's
(the output embedding's parent) and the output embedding's. When the model is called with
labels while gradients are on, the model's forward takes the labels away, and the output
embedding, called by the model's own forward with the hidden states, returns the chunked loss
instead of logits; so the loss is computed inside the head's module (profiles and plans see
its working set there, as the head's), and the logits never exist.

**What the model returns under such a plan.** Hugging Face causal LMs: an output whose
``loss`` equals what the model computes itself (its shift, ``ignore_index=-100``, the mean over
non-ignored tokens or the sum over ``num_items_in_batch``) and whose ``logits`` is ``None``.
The zoo GPT (:class:`superneurons.models.gpt.GPT`): ``model(idx, targets)`` returns the loss, as
without the plan. Without labels (or under ``torch.no_grad()``, e.g. evaluation and
generation) both models run as shipped and return their logits.

A model that transforms its logits after the output embedding (soft-capping, scaling) is
refused at its first call: the chunked loss could not reproduce it.

**Adapters and TRL.** The output embedding is found where it lives: PEFT's wrappers
(``PeftModelForCausalLM`` -> ``LoraModel``) forward ``get_output_embeddings`` to the causal LM
inside them, whose forward is the one patched (its fqn ``base_model.model.lm_head``), so an
adapter fine-tune goes below its head as a full one does; the head's frozen weight gets no
gradient. A call with TRL's ``fused_lm_head=True`` runs TRL's own fused forward with its kernel
in chunks of tokens (:mod:`.fused`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory.chunked.fused import fused_forward, trl_fused_head
from superneurons.memory.chunked.headloss import linear_cross_entropy
from superneurons.memory.chunked.vocab import RowSource, vocab_cross_entropy
from superneurons.memory.forwards import ForwardPatches
from superneurons.memory.plan import HeadChunking

__all__ = ["HeadHandle", "chunk_head", "find_output_embedding"]

_IGNORE = -100  # Hugging Face's and F.cross_entropy's ignore_index


def find_output_embedding(model: nn.Module) -> str | None:
    """The fqn of ``model``'s output embedding when its head can run in chunks: a Hugging Face
    causal LM's ``get_output_embeddings()`` or the zoo GPT's ``lm_head``, searched among
    ``model`` and its submodules (the first causal LM found that holds its head as a child);
    None otherwise.

    Wrappers that forward ``get_output_embeddings`` to a model inside them (PEFT's
    ``PeftModelForCausalLM`` -> ``LoraModel`` -> the causal LM) are passed over: the causal LM
    that holds the head computes the loss from its logits, so its forward is the one to patch.
    """
    for fqn, module in model.named_modules():
        head = _head_of(module)
        name = _name_in(module, head) if head is not None else None
        if name is not None:
            return _child_fqn(fqn, name)
    return None


def _head_of(module: nn.Module) -> nn.Module | None:
    if _style(module) is None:
        return None
    getter = getattr(module, "get_output_embeddings", None)
    head = getter() if callable(getter) else getattr(module, "lm_head", None)
    return head if isinstance(head, nn.Linear) else None


def _style(module: nn.Module) -> str | None:
    """``"hf"`` (labels, shifted inside), ``"targets"`` (the zoo GPT: targets aligned), None."""
    from superneurons.models.gpt import GPT

    if isinstance(module, GPT):
        return "targets"
    if hasattr(module, "loss_function") and hasattr(module, "get_output_embeddings"):
        kind = getattr(getattr(module, "config", None), "is_encoder_decoder", False)
        return None if kind else "hf"
    return None


def _name_in(parent: nn.Module, child: nn.Module) -> str | None:
    """``child``'s name among ``parent``'s children; None for a wrapper's forwarded head."""
    for name, module in parent.named_children():
        if module is child:
            return name
    return None


def _child_fqn(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


@dataclass
class _Call:
    """The labels of the call in flight (set by the model's forward, read by the head's)."""

    labels: torch.Tensor | None = None
    shifted: bool = False
    num_items: Any = None
    ignore_index: int = _IGNORE
    loss: torch.Tensor | None = None


class HeadHandle(ForwardPatches):
    """Undoes :func:`chunk_head` (``remove()``, idempotent).

    Attributes:
        rows: under a head plan with ``vocab_rows``, where the weight's slices come from when
            its weights stream (set by ``apply_plan``); None: the resident weight's views.
    """

    def __init__(self) -> None:
        super().__init__()
        self.rows: RowSource | None = None


def chunk_head(model: nn.Module, decision: HeadChunking) -> HeadHandle:
    """Make ``model``'s head + loss run as ``decision`` says until the handle is removed.

    Raises:
        ConfigError: ``decision.fqn`` is not a chunkable output embedding of ``model``.
    """
    parent_fqn, _, name = decision.fqn.rpartition(".")
    try:
        lm = model.get_submodule(parent_fqn)
        head = model.get_submodule(decision.fqn)
    except AttributeError as exc:
        raise ConfigError(
            f"the plan chunks {decision.fqn!r}, which {type(model).__name__} does not have: "
            "re-plan this model"
        ) from exc
    style = _style(lm)
    if style is None or _head_of(lm) is not head:
        raise ConfigError(
            f"{decision.fqn!r} is not the output embedding of a Hugging Face causal LM or the "
            "zoo GPT: only their head + loss can run in chunks"
        )
    call = _Call()
    handle = HeadHandle()
    handle.patch(lm, _model_forward(lm, lm.forward, call, style, decision))
    handle.patch(head, _head_forward(head, head.forward, call, decision, handle))
    return handle


def _model_forward(
    lm: nn.Module, forward: Callable[..., Any], call: _Call, style: str, decision: HeadChunking
) -> Callable[..., Any]:
    name = type(lm).__name__
    fused = trl_fused_head(forward)  # TRL's fused LM head, patched on by its SFTTrainer

    # the model's own signature stays visible (``model(**batch)`` callers inspect it)
    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        key = "labels" if style == "hf" else "targets"
        if style == "targets" and len(args) > 1:  # GPT(idx, targets)
            args, kwargs = args[:1], {**kwargs, "targets": args[1]}
        if kwargs.get(key) is None or not torch.is_grad_enabled():
            return forward(*args, **kwargs)  # no loss asked, or no backward
        if kwargs.get("fused_lm_head"):  # TRL's fused head (``add_fused_lm_head``), in chunks
            if fused is None or decision.vocab_rows:
                raise ConfigError(
                    f"{name} was called with fused_lm_head=True, but its forward is not TRL's "
                    "fused LM head as TRL 1.x patches it, or the plan slices the vocabulary "
                    "(TRL's kernel reads the whole weight): plan without head chunking"
                )
            return fused_forward(lm, fused, decision.chunk_tokens, args, kwargs)
        kwargs = dict(kwargs)
        labels = kwargs.pop(key)
        shift = kwargs.pop("shift_labels", None) if style == "hf" else None
        call.labels, call.shifted = (shift, True) if shift is not None else (labels, style != "hf")
        call.num_items = kwargs.pop("num_items_in_batch", None) if style == "hf" else None
        call.ignore_index = int(kwargs.pop("ignore_index", _IGNORE))
        try:
            out = forward(*args, **kwargs)
            loss, call.loss = call.loss, None
        finally:
            call.labels = call.num_items = call.loss = None
        logits = out.get("logits") if hasattr(out, "get") else out
        if loss is None or logits is not loss:
            raise ConfigError(
                f"{name} transforms its logits after the output embedding (or does not call "
                "it): its loss cannot run in chunks; plan without head chunking"
            )
        if style == "targets":
            return loss
        fields = {k: v for k, v in out.items() if k not in ("logits", "loss")}
        return type(out)(loss=loss, **fields)

    return wrapped


def _head_forward(
    head: nn.Module,
    forward: Callable[..., Any],
    call: _Call,
    decision: HeadChunking,
    handle: HeadHandle,
) -> Callable[..., Any]:
    def wrapped(hidden: torch.Tensor) -> torch.Tensor:
        if call.labels is None:
            return forward(hidden)
        labels = call.labels.to(hidden.device)
        if not call.shifted:  # Hugging Face's shift: position t predicts token t + 1
            labels = F.pad(labels, (0, 1), value=call.ignore_index)[..., 1:]
        linear = cast(nn.Linear, head)
        if decision.vocab_rows:  # the weight in vocabulary slices (streamed: handle.rows)
            call.loss = vocab_cross_entropy(
                hidden.reshape(-1, hidden.shape[-1]),  # (B*T, H)
                linear.weight,  # (V, H)
                labels.reshape(-1),  # (B*T,)
                vocab_rows=decision.vocab_rows,
                source=handle.rows,
                bias=linear.bias,
                ignore_index=call.ignore_index,
                num_items=call.num_items,
            )
            return call.loss
        call.loss = linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]),  # (B*T, H)
            linear.weight,  # (V, H)
            labels.reshape(-1),  # (B*T,)
            bias=linear.bias,
            chunk_tokens=decision.chunk_tokens,
            mode=decision.mode,
            ignore_index=call.ignore_index,
            num_items=call.num_items,
            impl=decision.impl,
        )
        return call.loss

    return wrapped
