"""Memory-centric blocks (memory.chunked.seqchunk): a block's MLP split over the sequence, each
piece under its own checkpoint: outputs and gradients equal to the whole MLP within fp32 rounding,
the split chosen from the profile's bytes, and the block's working set down in a profile."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory import profile_step
from superneurons.memory.chunked.seqchunk import MIN_PIECE_TOKENS, sequence_splits, split_sequence
from superneurons.memory.plan import SeqChunking
from superneurons.memory.planner.bounds import working_sets

transformers = pytest.importorskip("transformers")

SEQ = 512


def _llama(intermediate: int = 512) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
        max_position_embeddings=SEQ, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).train()


def _step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def test_split_mlp_equals_the_whole_one() -> None:
    eager = _llama()
    split = copy.deepcopy(eager)
    ids = torch.randint(0, 64, (2, SEQ))
    reference = _step(eager, ids)
    reference.backward()
    handle = split_sequence(split, [SeqChunking(f"model.layers.{i}.mlp", 3) for i in range(2)])
    loss = _step(split, ids)  # 512 tokens in pieces of 171, 171, 170
    loss.backward()
    handle.remove()
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=0)
    for (fqn, a), b in zip(eager.named_parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=fqn)
    assert "forward" not in split.model.layers[0].mlp.__dict__
    with pytest.raises(ConfigError, match="does not have"):
        split_sequence(split, [SeqChunking("model.layers.9.mlp", 2)])


class _Step(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _step(self.model, ids)


def test_split_comes_from_bytes_and_lowers_the_block_working_set() -> None:
    step = _Step(_llama(intermediate=1024))
    ids = torch.randint(0, 64, (1, SEQ))
    units = ["model.model.layers.0", "model.model.layers.1"]

    def loss_fn(out: torch.Tensor, _t: object) -> torch.Tensor:
        return out

    profile = profile_step(step, ids, None, loss_fn, units=units, fake=True, keep_output=False)
    splits = sequence_splits(profile, seq_len=SEQ, units=units)
    # the MLP saves four (T, 1024) tensors against the block's (T, 32) input: > 32x, but
    # pieces keep MIN_PIECE_TOKENS tokens: 512 / 128 = 4
    assert splits == tuple(SeqChunking(f"{u}.mlp", SEQ // MIN_PIECE_TOKENS) for u in units)
    assert sequence_splits(profile, seq_len=SEQ, units=units[:1]) == splits[:1]

    def prepare(model: nn.Module) -> object:
        return split_sequence(model, splits)

    split = profile_step(
        step, ids, None, loss_fn, units=units, fake=True, keep_output=False, prepare=prepare
    )
    before, after = working_sets(profile), working_sets(split)
    for unit in units:
        assert after[unit] < 0.6 * before[unit]
