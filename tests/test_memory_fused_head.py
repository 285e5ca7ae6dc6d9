"""TRL's fused LM head in chunks, under the wrappers Accelerate puts around a model's forward.

Accelerate's ``prepare`` under mixed precision (``bf16=True``, TRL's default) wraps the forward
TRL patched: a plain function, ``ConvertOutputsToFp32`` and an autocast decorator. The chunked
forward sees through them and runs inside the same ones, so it computes what TRL's does.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("accelerate")

from superneurons.memory.chunked.fused import fused_forward, patched_by_trl, trl_fused_head


def _patched_llama(*, bf16: bool) -> torch.nn.Module:
    """A tiny Llama with TRL's fused head, prepared by Accelerate under bf16 if ``bf16``."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    add_fused_lm_head(model)
    if not bf16:
        return model
    # NOTE: Accelerate's state is one per process: reset it around this test's accelerator
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        return Accelerator(cpu=True, mixed_precision="bf16").prepare_model(model)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def test_the_patch_is_read_through_accelerates_bf16_wrappers() -> None:
    model = _patched_llama(bf16=True)
    head = trl_fused_head(model.forward)
    assert head is not None and patched_by_trl(model.forward)
    assert len(head.wrappers) == 3  # the plain function, ConvertOutputsToFp32, autocast
    bare = _patched_llama(bf16=False)
    bare_head = trl_fused_head(bare.forward)
    assert bare_head is not None and bare_head.wrappers == ()


def test_chunked_forward_under_the_wrappers_is_trls_own() -> None:
    model, batch = _patched_llama(bf16=True), _batch()
    head = trl_fused_head(model.forward)
    assert head is not None
    tokens = batch["input_ids"].numel()
    with torch.no_grad():
        theirs = model(**batch, fused_lm_head=True)
        ours = fused_forward(model, head, tokens, (), {**batch, "fused_lm_head": True})
        # without the wrappers the same forward runs in fp32: not what the trainer computes
        unwrapped = dataclasses.replace(head, wrappers=())
        plain = fused_forward(model, unwrapped, tokens, (), dict(batch))
    assert torch.equal(ours.loss, theirs.loss) and torch.equal(ours.log_probs, theirs.log_probs)
    assert ours.log_probs.dtype == theirs.log_probs.dtype == torch.float32
    assert not torch.equal(plain.log_probs, theirs.log_probs)


def test_an_unknown_wrapper_hides_the_patch() -> None:
    model = _patched_llama(bf16=False)
    inner = model.forward

    @functools.wraps(inner)
    def logged(*args: object, **kwargs: object) -> object:
        return inner(*args, **kwargs)

    assert trl_fused_head(logged) is None and not patched_by_trl(logged)
