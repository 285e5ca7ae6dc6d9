"""Memory-centric blocks: position-wise sub-layers run over pieces of the sequence.

At long sequences one transformer block's backward binds the peak: recomputed, it holds every
tensor its forward saved, and its MLP's are the widest (Llama-3-8B at ``T = 8192``: four
``T x 14336`` tensors, 0.9 GiB of the block's 2.25 GiB). SuperNeurons recomputes a segment that
does not fit piece by piece, never exceeding the peak layer's memory (memory-centric
recomputation, Wang et al., PPoPP'18 §3.3). A position-wise layer (it mixes no information
across positions) splits exactly along the sequence: each piece runs under its own
non-reentrant checkpoint, which saves only the piece's input (a view of the layer's input: no
copy), so the layer's intermediates exist for one piece at a time, in forward and again in
backward. The cost is one more forward of the layer. The same holds for a block's RMS norms where
they compute in fp32 on a bf16 stream: whole, each keeps an fp32 copy of its input (twice the
input's bytes) for backward; in pieces, one piece's copy at a time.

:func:`sequence_splits` proposes the split from bytes (the profile's saved tensors of each
block's ``mlp`` and norms); :func:`split_sequence` installs it (instance ``forward`` attributes,
removed by the handle).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from superneurons.errors import ConfigError
from superneurons.memory.forwards import ForwardPatches
from superneurons.memory.plan import SeqChunking
from superneurons.memory.profile_types import Profile

__all__ = ["MIN_PIECE_TOKENS", "SplitHandle", "sequence_splits", "split_sequence"]

# position-wise sub-layers by name: Hugging Face's decoder layers (Llama, Qwen2, Mistral, GPT-2)
# and the zoo GPT call their feed-forward ``mlp``; Llama, Qwen2 and Mistral call their RMS norms
# ``input_layernorm`` and ``post_attention_layernorm``
POSITION_WISE = ("mlp", "input_layernorm", "post_attention_layernorm")
# NOTE: a norm that computes in its input's dtype saves about its input, which a piece's
# checkpoint keeps anyway; one that computes wider (HF's RMSNorm upcasts bf16 to fp32) saves the
# wide copy, twice its input. Only a norm that saves a cast of its input is split.
NORMS = ("input_layernorm", "post_attention_layernorm")
CAST = "_to_copy"
# NOTE: a piece of fewer tokens turns the layer's GEMMs skinny (M < 128) and the loop
# launch-bound; the split never goes below it.
MIN_PIECE_TOKENS = 128


def sequence_splits(
    profile: Profile, *, seq_len: int, units: Sequence[str] | None = None
) -> tuple[SeqChunking, ...]:
    """Split each unit's position-wise sub-layer into ``k`` pieces, ``k`` the smallest power of
    two for which one piece's saved bytes do not exceed the unit's input (the checkpoint a
    recompute keeps): the block's working set then no longer grows with the MLP's width.
    Pieces keep at least :data:`MIN_PIECE_TOKENS` tokens; sub-layers saving less than the
    unit's input are left whole."""
    chosen = set(units) if units is not None else None
    saved: dict[str, int] = {}
    widened: set[str] = set()
    for tensor in profile.saved:
        for name in POSITION_WISE:
            marker = f".{name}"
            head, found, tail = tensor.module.partition(marker)
            if found and (tail == "" or tail.startswith(".")) and tensor.unit == head:
                saved[head + marker] = saved.get(head + marker, 0) + tensor.nbytes
                if tensor.op == CAST:
                    widened.add(head + marker)
    splits = []
    for unit in profile.units:
        if chosen is not None and unit.fqn not in chosen:
            continue
        input_bytes = max(unit.input_bytes, unit.unsaved_input_bytes, 1)
        for name in POSITION_WISE:
            fqn = f"{unit.fqn}.{name}"
            if name in NORMS and fqn not in widened:
                continue  # saves about its input: pieces would keep as much
            pieces = 1
            while saved.get(fqn, 0) > pieces * input_bytes:
                pieces *= 2
            pieces = min(pieces, max(seq_len // MIN_PIECE_TOKENS, 1))
            if pieces >= 2:
                splits.append(SeqChunking(fqn, pieces))
    return tuple(splits)


class SplitHandle(ForwardPatches):
    """Undoes :func:`split_sequence` (``remove()``, idempotent)."""


def split_sequence(model: nn.Module, splits: Sequence[SeqChunking]) -> SplitHandle:
    """Run each ``splits`` sub-layer over its pieces of the sequence (dimension 1 of its
    ``(B, T, ...)`` input) until the handle is removed.

    Raises:
        ConfigError: a fqn is not a submodule of ``model``.
    """
    handle = SplitHandle()
    try:
        for split in splits:
            try:
                module = model.get_submodule(split.fqn)
            except AttributeError as exc:
                raise ConfigError(
                    f"the plan splits {split.fqn!r}, which {type(model).__name__} does not "
                    "have: re-plan this model"
                ) from exc
            handle.patch(module, _pieces(module.forward, split.chunks))
    except BaseException:
        handle.remove()
        raise
    return handle


def _pieces(forward: Callable[..., Any], chunks: int) -> Callable[..., Any]:
    def wrapped(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not torch.is_grad_enabled() or x.dim() < 3:
            return forward(x, *args, **kwargs)  # not the (B, T, ...) call this split is for
        pieces = x.chunk(chunks, dim=1)  # views of x: each checkpoint saves its piece only
        outs = [checkpoint(forward, piece, use_reentrant=False) for piece in pieces]
        return torch.cat(outs, dim=1)  # (B, T, ...)

    return wrapped
