"""TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``, TRL 1.x) in chunks of tokens.

TRL's ``SFTTrainer`` patches the causal LM's ``forward`` so that ``model(**batch,
fused_lm_head=True)`` runs the backbone and returns per-token log-probabilities (and the
entropy and top-1 flags its metrics log) instead of logits. Its kernel
(``trl.kernels.ChunkedLogProbFunction``) tiles the head by up to 4096 tokens x 32768
vocabulary entries whatever the model (``TOKEN_CHUNK_SIZE``; ``mm_buf`` in
``trl/kernels/chunked_logprob.py``): 128 KiB per token for each fp32 tile, and its CPU path holds
several tiles at once (the logits, their scaled copies, their exponentials). On a tiny Llama with
a 32k vocabulary (batch 4 x 128, LoRA) TRL's step peaked at 563 MiB with its gradient
checkpointing on, its head binding: nothing a plan of the blocks can lower.

Under a plan with :class:`~superneurons.memory.plan.HeadChunking`, :func:`fused_forward` runs
the same forward with the same kernel on ``chunk_tokens`` tokens at a time, each chunk its own
autograd node that recomputes its tile in backward as TRL's does (so the mode is always
``recompute``, and the plan's ``impl`` is not used: the kernel is TRL's): the head's working
set falls to a chunk's tiles. The arithmetic of every token
is TRL's own (one row of the same GEMM, the same fold); only the GEMM's row count differs. Every
position is scored, as TRL does off Triton devices, so no data-dependent op runs.

The settings TRL closed over when it patched the model (temperature, soft-capping, logit scale,
the fields to compute) are read from the patched forward's closure (:func:`trl_fused_head`); a
patch whose closure does not name them (another TRL version) is not chunked: ``head_chunking``
offers no chunking for it (:func:`patched_by_trl`), and a plan made elsewhere is refused at its
first fused call.

Accelerate's ``prepare`` wraps a model's forward again under mixed precision (``bf16=True``,
TRL's default): an autocast decorator, then ``ConvertOutputsToFp32``. Those two wrappers are
seen through, and the chunked forward runs inside the same ones (same autocast, outputs cast
to fp32), so its arithmetic stays the trainer's. Any other wrapper hides the patch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from superneurons.errors import ConfigError

__all__ = ["TrlFusedHead", "fused_forward", "patched_by_trl", "trl_fused_head"]

# What TRL 1.x's ``_fused_forward`` closes over (``add_fused_lm_head``'s locals).
_SETTINGS = (
    "original_forward",
    "temperature",
    "cast_lm_head_to_fp32",
    "outputs",
    "final_logit_softcapping",
    "logit_scale",
    "backbone_attr",
    "text_config",
)


# wraps a function as one of Accelerate's wrappers did (a class, or an autocast instance)
Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


@dataclass(frozen=True)
class TrlFusedHead:
    """The settings of one model's TRL fused head (read from its patched forward)."""

    temperature: float
    cast_lm_head_to_fp32: bool
    outputs: tuple[str, ...]
    final_logit_softcapping: float | None
    logit_scale: float
    backbone_attr: str
    text_config: Any
    # what Accelerate wrapped around the patch, outermost first: each wraps a function again
    wrappers: tuple[Wrapper, ...] = ()


def patched_by_trl(forward: Callable[..., Any]) -> bool:
    """``forward`` is a fused LM head TRL patched on (whether or not this module can read it),
    bare or under Accelerate's mixed-precision wrappers."""
    return _trl_patch(forward) is not None


def _is_trl_patch(func: Any) -> bool:
    # NOTE: TRL wraps it with functools.wraps(type(model).forward), so its __name__ and
    # __module__ are the model's: its code and globals say whose it is
    code = getattr(func, "__code__", None)
    if code is None or code.co_name != "_fused_forward":
        return False
    return str(getattr(func, "__globals__", {}).get("__name__", "")).startswith("trl.")


def _trl_patch(forward: Callable[..., Any]) -> tuple[Any, tuple[Wrapper, ...]] | None:
    """TRL's patched function under ``forward`` and the wrappers around it (outermost first),
    or None when ``forward`` is not TRL's patch under wrappers this module knows."""
    func: Any = getattr(forward, "__func__", forward)
    wrappers: list[Wrapper] = []
    while not _is_trl_patch(func):
        layer = _layer(func)
        if layer is None:
            return None
        wrapper, func = layer
        wrappers.append(wrapper)
    return func, tuple(wrappers)


def _passes_through(func: Callable[..., Any]) -> Callable[..., Any]:
    return func


def _layer(func: Any) -> tuple[Wrapper, Any] | None:
    """One wrapper Accelerate's ``prepare`` puts around a forward under mixed precision (how to
    wrap a function the same way, and the function it wraps), or None."""
    if type(func).__name__ == "ConvertOutputsToFp32" and hasattr(func, "model_forward"):
        return type(func), func.model_forward
    if getattr(func, "__qualname__", "") == "convert_outputs_to_fp32.<locals>.forward":
        return _passes_through, func.__wrapped__  # a plain function around ConvertOutputsToFp32
    code = getattr(func, "__code__", None)
    if code is None or code.co_name != "decorate_autocast":  # torch.autocast used as a decorator
        return None
    cells = dict(zip(code.co_freevars, func.__closure__ or (), strict=True))
    if "autocast_instance" not in cells or "func" not in cells:
        return None
    autocast = cells["autocast_instance"].cell_contents
    if not isinstance(autocast, torch.autocast):
        return None
    return autocast, cells["func"].cell_contents


def trl_fused_head(forward: Callable[..., Any]) -> TrlFusedHead | None:
    """The settings of TRL's fused LM head when ``forward`` is TRL 1.x's patched forward, else
    None."""
    found = _trl_patch(forward)
    if found is None:
        return None
    func, wrappers = found
    code = func.__code__
    cells = dict(zip(code.co_freevars, func.__closure__ or (), strict=True))
    if any(name not in cells for name in _SETTINGS) or not _has_kernel():
        return None
    value = {name: cells[name].cell_contents for name in _SETTINGS}
    return TrlFusedHead(
        temperature=float(value["temperature"]),
        cast_lm_head_to_fp32=bool(value["cast_lm_head_to_fp32"]),
        outputs=tuple(value["outputs"]),
        final_logit_softcapping=value["final_logit_softcapping"],
        logit_scale=float(value["logit_scale"]),
        backbone_attr=str(value["backbone_attr"]),
        text_config=value["text_config"],
        wrappers=wrappers,
    )


def fused_forward(
    lm: nn.Module, head: TrlFusedHead, chunk_tokens: int, args: tuple[Any, ...], kwargs: Any
) -> Any:
    """``lm(*args, **kwargs, fused_lm_head=True)`` as TRL's fused forward computes it, the
    head's kernel run on ``chunk_tokens`` tokens at a time, inside the wrappers Accelerate put
    around TRL's patch (module docstring)."""

    def bare(*args: Any, **kwargs: Any) -> Any:
        return _fused_forward(lm, head, chunk_tokens, args, kwargs)

    call: Callable[..., Any] = bare
    for wrap in reversed(head.wrappers):
        call = wrap(call)
    return call(*args, **kwargs)


def _fused_forward(
    lm: nn.Module, head: TrlFusedHead, chunk_tokens: int, args: tuple[Any, ...], kwargs: Any
) -> Any:
    from trl.trainer import utils as trl_utils

    kwargs = dict(kwargs)
    kwargs.pop("fused_lm_head", None)
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    if getattr(head.text_config, "output_router_logits", False) or kwargs.get(
        "output_router_logits"
    ):
        raise ConfigError(
            f"{type(lm).__name__} adds a router loss to TRL's fused head (a mixture of experts): "
            "its head cannot run in chunks here; plan without head chunking"
        )
    kwargs["use_cache"] = False
    backbone = getattr(lm, head.backbone_attr)(*args, **kwargs)
    if shift_labels is None:
        hidden, labels = backbone.last_hidden_state[:, :-1], labels[:, 1:]  # (B, T-1, H)
    else:
        hidden, labels = backbone.last_hidden_state, shift_labels
    linear: Any = lm.get_output_embeddings()  # type: ignore[operator]
    weight, bias = linear.weight, linear.bias  # (V, H), (V,)
    hidden, labels = hidden.to(weight.device), labels.to(weight.device)
    mask = labels != -100  # (B, T')
    flat = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    if head.cast_lm_head_to_fp32:
        flat = flat.float()
    targets = labels.clamp(min=0).reshape(-1)  # (N,)
    fields = _in_chunks(trl_utils, head, flat, weight, bias, targets, chunk_tokens)
    per_token = [None if x is None else x.view(mask.shape).masked_fill(~mask, 0) for x in fields]
    log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = per_token
    assert log_probs is not None
    loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items is None else num_items)
    return trl_utils.FusedCausalLMOutput(
        loss=loss,
        log_probs=log_probs,
        entropy=entropy,
        log_sum_sq_probs=log_sum_sq_probs,
        mean_logits=mean_logits,
        is_top1=is_top1,
        label_mask=mask,
        aux_loss=None,
    )


def _in_chunks(
    trl_utils: Any,
    head: TrlFusedHead,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk_tokens: int,
) -> list[torch.Tensor | None]:
    """TRL's kernel on ``chunk_tokens`` rows at a time; its five per-token fields, each
    ``(N,)`` (None where TRL computes none)."""
    autocast = (
        torch.autocast(hidden.device.type, enabled=False)
        if head.cast_lm_head_to_fp32
        else contextlib.nullcontext()
    )
    pieces: list[tuple[Any, ...]] = []
    with autocast, trl_utils.maybe_gather_lm_head_ctx(weight, bias):
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            pieces.append(
                trl_utils._ChunkedLogProbFunction.apply(
                    hidden[rows],
                    weight,
                    bias,
                    targets[rows],
                    head.temperature,
                    trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE,
                    head.final_logit_softcapping,
                    head.logit_scale,
                    head.outputs,
                )
            )
    return [
        None if column[0] is None else torch.cat(column) for column in zip(*pieces, strict=True)
    ]


def _has_kernel() -> bool:
    """TRL's kernel and tile width where TRL 1.x keeps them (``trl.trainer.utils``)."""
    try:
        from trl.trainer import utils as trl_utils
    except ImportError:  # pragma: no cover - a patch by TRL implies TRL
        return False
    names = ("_ChunkedLogProbFunction", "_CHUNKED_LOGPROB_CHUNK_SIZE", "FusedCausalLMOutput")
    return all(hasattr(trl_utils, name) for name in (*names, "maybe_gather_lm_head_ctx"))
