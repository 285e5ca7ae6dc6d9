"""Below the largest layer: profiles of the same step with its widest layers evaluated in chunks.

SuperNeurons' claim is a peak down to the largest layer's working set (Wang et al., PPoPP'18);
its memory-centric recomputation goes further, splitting what does not fit (§3.3). For a
language model the two widest layers are the LM head with its loss (``N x V`` logits) and, at
long sequences, each block's MLP. :func:`below_profiles` profiles the step again with them in
chunks, in the order a planner should try them (``make_plan(..., chunked=...)``): the cheapest
first, the smallest last:

1. the head + loss in chunks computing its gradients in the forward (no extra FLOPs; holds
   ``dW`` and ``dh`` from forward to backward);
2. the head + loss in chunks recomputing its logits in backward (+33% of the head's FLOPs);
3. that, and each block's MLP run over pieces of the sequence (one more forward of the MLP);
4. that, with the head's weight read in slices of the vocabulary (:mod:`.chunked.vocab`): the
   same FLOPs as 3, for a plan that streams the head's weights from the host (only
   ``stream-weights`` searches it), which then fetches one slice at a time and sends each
   slice's gradient to the host (``memory.planner.weights``); not offered for a head whose weight is
   tied to the input embedding, nor under ``impl="exact"`` (its gradients are the unchunked
   loss's within 1e-6, not bit for bit).

Every one of them also keeps LoRA adapters' inputs at the base's precision where PEFT would
save an fp32 copy (:mod:`.chunked.adapter_inputs`; bit for bit eager's gradients).

Chunk sizes come from bytes (:func:`.headloss.chunk_tokens_for`, :func:`.seqchunk.
sequence_splits`), so the same rule serves a 32k-vocabulary toy and Llama-3-8B at 128k tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, cast

import torch
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory.chunked.adapter_inputs import adapter_inputs, keep_adapter_inputs
from superneurons.memory.chunked.fused import patched_by_trl, trl_fused_head
from superneurons.memory.chunked.headloss import chunk_tokens_for, resolve_implementation
from superneurons.memory.chunked.lmhead import chunk_head, find_output_embedding
from superneurons.memory.chunked.seqchunk import sequence_splits, split_sequence
from superneurons.memory.chunked.vocab import vocab_rows_for
from superneurons.memory.plan import HeadChunking, SeqChunking
from superneurons.memory.profile_types import Profile
from superneurons.memory.profiling.step import profile_step

__all__ = ["VARIANTS", "below_profiles", "head_chunking"]

VARIANTS: tuple[str, ...] = ("grad-in-forward", "recompute", "recompute+split", "vocab")

LossFn = Callable[[Any, Any], torch.Tensor]


def head_chunking(
    model: nn.Module, *, tokens: int, mode: str, impl: str = "auto", vocab: bool = False
) -> HeadChunking | None:
    """The head chunking of ``model`` (or of the causal LM inside it, PEFT's wrappers passed
    over) for ``tokens`` tokens a step, None when it has no chunkable head or cannot run
    ``mode``: ``impl="exact"`` and TRL's fused head (whose kernel recomputes its tiles in
    backward, chunk by chunk too) recompute only. ``vocab``: the head's weight in vocabulary
    slices (:func:`.chunked.vocab.vocab_rows_for`; recompute, the project's loop), None for TRL's
    fused head, for a weight tied to another module's and under ``impl="exact"`` (the online
    log-sum-exp is not the unchunked loss's bit for bit)."""
    fqn = find_output_embedding(model)
    if fqn is None:
        return None
    lm = model.get_submodule(fqn.rpartition(".")[0])
    trl = patched_by_trl(lm.forward)
    if trl and (mode != "recompute" or vocab or trl_fused_head(lm.forward) is None):
        return None  # TRL's fused head: its kernel in chunks, recomputing, when it can be read
    if mode != "recompute" and impl == "exact":
        return None
    weight = cast(nn.Linear, model.get_submodule(fqn)).weight  # (V, H)
    size, hidden = int(weight.shape[0]), int(weight.shape[1])
    chunk = chunk_tokens_for(tokens, hidden, size)
    if vocab:  # NOTE: not bitwise the unchunked loss's gradients: never under impl="exact"
        if mode != "recompute" or impl == "exact" or _tied(model, weight):
            return None
        rows = vocab_rows_for(tokens, hidden, size, weight.element_size())
        return HeadChunking(fqn, chunk, "recompute", "pure", vocab_rows=rows)
    impl = resolve_implementation(impl, dtype=weight.dtype, device=weight.device)
    return HeadChunking(fqn, chunk, mode, impl)


def _tied(model: nn.Module, weight: torch.Tensor) -> bool:
    """``weight`` is held by more than one module (an input embedding tied to the head)."""
    holders = [m for m in model.modules() if any(p is weight for p in m.parameters(False))]
    return len(holders) > 1


def below_profiles(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    profile: Profile,
    tokens: int,
    seq_len: int,
    units: Sequence[str] | None = None,
    fake_mode: Any = None,
    fake: bool = False,
    keep_output: bool = True,
    variants: Sequence[str] = VARIANTS,
    carry_output: bool = False,
    autocast: torch.dtype | None = None,
    impl: str = "auto",
) -> list[Profile]:
    """Profiles of the step :func:`profile_step` profiled as ``profile`` (same arguments), with
    the head + loss in chunks and block MLPs split over the sequence (module docstring), in the
    order to try them; ``[]`` for a model without a chunkable head or MLPs.

    Args:
        profile: the plain profile of the step (the MLP splits are read from it).
        tokens: tokens the head sees per step (batch x sequence length).
        seq_len: the sequence length (pieces keep at least ``seqchunk.MIN_PIECE_TOKENS``).
        variants: which of :data:`VARIANTS` to profile (``("recompute+split",)``: the floor
            only, one profile instead of three).
        carry_output / autocast: as :func:`profile_step`.
        impl: the head's implementation (:func:`.headloss.resolve_implementation`;
            ``"exact"``: the unchunked loss's gradients bit for bit, recompute only).
    """
    unit_fqns = list(units) if units is not None else [u.fqn for u in profile.units]
    splits = sequence_splits(profile, seq_len=seq_len, units=unit_fqns)
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ConfigError(f"unknown variants {sorted(unknown)}: use some of {', '.join(VARIANTS)}")
    kept = adapter_inputs(model)
    chosen: list[tuple[HeadChunking | None, tuple[SeqChunking, ...]]] = []
    for mode in ("grad-in-forward", "recompute"):
        head = head_chunking(model, tokens=tokens, mode=mode, impl=impl)
        if head is not None and mode in variants:
            chosen.append((head, ()))
    if splits and "recompute+split" in variants:
        chosen.append((head_chunking(model, tokens=tokens, mode="recompute", impl=impl), splits))
    sliced = head_chunking(model, tokens=tokens, mode="recompute", impl=impl, vocab=True)
    if sliced is not None and "vocab" in variants:
        chosen.append((sliced, splits))
    options: dict[str, Any] = dict(
        units=unit_fqns,
        fake_mode=fake_mode,
        fake=fake,
        keep_output=keep_output,
        carry_output=carry_output,
        autocast=autocast,
    )
    profiles = []
    for head, split in chosen:
        prepared = profile_step(
            model,
            inputs,
            targets,
            loss_fn,
            optimizer,
            prepare=_chunker(head, split, kept),
            **options,
        )
        profiles.append(replace(prepared, head=head, seq_chunks=split, adapter_inputs=kept))
    return profiles


class _Undo:
    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in reversed(self.handles):
            handle.remove()


def _chunker(
    head: HeadChunking | None, splits: tuple[SeqChunking, ...], kept: tuple[str, ...]
) -> Callable[[nn.Module], _Undo]:
    """Install ``head``, ``splits`` and the ``kept`` adapter inputs on the model a profile runs
    (the copy)."""

    def prepare(model: nn.Module) -> _Undo:
        handles: list[Any] = [chunk_head(model, head)] if head is not None else []
        handles.append(split_sequence(model, splits))
        handles.append(keep_adapter_inputs(model, kept))
        return _Undo(handles)

    return prepare
