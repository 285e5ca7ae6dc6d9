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


def test_norms_that_compute_wider_than_their_input_split() -> None:
    """HF's RMSNorm on a bf16 stream saves an fp32 copy of its input (twice its bytes): such
    norms are split; in fp32 the copy is the input itself and they stay whole. Split, the loss
    and every gradient but the norms' own weights' are eager's bit for bit (with the weights
    frozen, as under LoRA, everything is); those add one sum per piece in bf16."""
    units = ["model.model.layers.0", "model.model.layers.1"]
    ids = torch.randint(0, 64, (1, SEQ))

    def wide_llama() -> nn.Module:  # wide enough that the norms outweigh the causal mask
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            hidden_size=512, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, vocab_size=64, max_position_embeddings=SEQ, use_cache=False,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config).train()

    def loss_fn(out: torch.Tensor, _t: object) -> torch.Tensor:
        return out

    def norms(dtype: torch.dtype) -> set[str]:
        step = _Step(wide_llama().to(dtype))
        profile = profile_step(step, ids, None, loss_fn, units=units, fake=True, keep_output=False)
        splits = sequence_splits(profile, seq_len=SEQ, units=units)
        return {s.fqn for s in splits if not s.fqn.endswith(".mlp")}

    assert norms(torch.float32) == set()
    wide = {f"{u}.{n}" for u in units for n in ("input_layernorm", "post_attention_layernorm")}
    assert norms(torch.bfloat16) == wide
    eager = wide_llama().to(torch.bfloat16)
    split = copy.deepcopy(eager)
    reference = _step(eager, ids)
    reference.backward()
    handle = split_sequence(split, [SeqChunking(f[len("model.") :], 4) for f in sorted(wide)])
    loss = _step(split, ids)
    loss.backward()
    handle.remove()
    assert torch.equal(loss, reference)
    for (fqn, a), b in zip(eager.named_parameters(), split.parameters(), strict=True):
        if "layernorm" in fqn:  # a sum over tokens, added piece by piece in bf16
            torch.testing.assert_close(b.grad, a.grad, rtol=2**-6, atol=2**-14, msg=fqn)
        else:  # every per-token result is the whole norm's, bit for bit
            assert torch.equal(b.grad, a.grad), fqn
