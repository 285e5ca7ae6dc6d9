"""Causal LMs as shipped under a plan that chunks the LM head + loss (memory.chunked.lmhead): tiny
HF Llama and GPT-2 configs and the zoo GPT, with labels: the loss equal to the model's own,
gradients equal within fp32 rounding, ``logits`` None, the model as shipped without labels; the
planner chunking only when the budget needs it, its prediction executed to the byte."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from superneurons.bench.memory.meter import allocator_peak_bytes
from superneurons.errors import ConfigError
from superneurons.memory import apply_plan, make_plan, min_peak_bytes, profile_step
from superneurons.memory.chunked.lmhead import chunk_head, find_output_embedding
from superneurons.memory.plan import HeadChunking, Plan, UnitDecision
from superneurons.memory.profile_types import ALLOCATOR_MARGIN_BYTES
from superneurons.memory.profiling.below import below_profiles, head_chunking

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 2000, 24, 2


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).train()


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).train()


MODELS: dict[str, Callable[[], nn.Module]] = {"llama": _llama, "gpt2": _gpt2}


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -5:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :6] = -100  # a prompt without loss
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _plan(model: nn.Module, head: HeadChunking) -> Plan:
    units = tuple(UnitDecision(f"model.layers.{i}", "recompute") for i in range(2))
    if isinstance(model, transformers.GPT2LMHeadModel):
        units = tuple(UnitDecision(f"transformer.h.{i}", "recompute") for i in range(2))
    return Plan(units=units, strategy="recompute", budget_bytes=1 << 30, head=head)


def _run(model: nn.Module, batch: dict, **extra: object) -> object:
    torch.manual_seed(7)  # GPT-2's dropout draws the same masks in both runs
    out = model(**batch, **extra)
    out.loss.backward()
    return out


@pytest.mark.parametrize("mode", ["recompute", "grad-in-forward"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_model_with_labels_under_a_head_plan(name: str, mode: str) -> None:
    torch.manual_seed(0)
    eager = MODELS[name]()
    planned = copy.deepcopy(eager)
    batch = _batch()
    fqn = find_output_embedding(planned)
    assert fqn == "lm_head"
    head = HeadChunking(fqn, chunk_tokens=7, mode=mode, impl="pure")  # 48 tokens: 7 chunks
    reference = _run(eager, batch)
    with apply_plan(planned, _plan(planned, head)):
        ours = _run(planned, batch)
        assert ours.logits is None and "logits" not in ours  # never materialised
        assert torch.allclose(ours.loss, reference.loss, rtol=1e-6, atol=0)
        items = torch.tensor(100)  # Trainer's num_items_in_batch: sum / items
        torch.manual_seed(8)
        ref_sum = eager(**batch, num_items_in_batch=items).loss
        torch.manual_seed(8)
        assert torch.allclose(planned(**batch, num_items_in_batch=items).loss, ref_sum, rtol=1e-6)
        with torch.no_grad():  # evaluation: the model as shipped, logits included
            assert planned(**batch).logits.shape == (BATCH, SEQ, VOCAB)
        no_labels = {k: v for k, v in batch.items() if k != "labels"}
        assert planned(**no_labels).logits.shape == (BATCH, SEQ, VOCAB)
    for (key, a), b in zip(eager.named_parameters(), planned.parameters(), strict=True):
        if a.grad is not None:
            relative = (a.grad - b.grad).norm() / a.grad.norm().clamp(min=1e-30)
            assert relative <= 1e-5, key
    assert "forward" not in planned.__dict__ and "forward" not in planned.lm_head.__dict__


def test_zoo_gpt_returns_the_loss_under_a_head_plan() -> None:
    from superneurons.models.gpt import gpt

    eager = gpt(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=32)
    planned = copy.deepcopy(eager)
    x, y = torch.randint(0, 300, (2, 32)), torch.randint(0, 300, (2, 32))
    y[1, :4] = -100
    reference = eager(x, y)
    reference.backward()
    plan = Plan(units=(), strategy="eager", budget_bytes=1 << 30, head=HeadChunking("lm_head", 10))
    with apply_plan(planned, plan):
        loss = planned(x, y)  # targets aligned with the positions: no shift
        loss.backward()
        assert planned(x).shape == (2, 32, 300)
    assert torch.allclose(loss, reference, rtol=1e-6, atol=0)
    for a, b in zip(eager.parameters(), planned.parameters(), strict=True):
        assert (a.grad - b.grad).norm() <= 1e-5 * a.grad.norm()


def test_a_model_that_transforms_its_logits_is_refused() -> None:
    config = transformers.Gemma2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=100, final_logit_softcapping=30.0,
    )  # fmt: skip
    model = transformers.Gemma2ForCausalLM(config).train()
    ids = torch.randint(0, 100, (1, 8))
    handle = chunk_head(model, HeadChunking(find_output_embedding(model) or "", 4))
    with pytest.raises(ConfigError, match="transforms its logits"):
        model(input_ids=ids, labels=ids)
    handle.remove()
    with pytest.raises(ConfigError, match="not the output embedding"):
        chunk_head(model, HeadChunking("model.embed_tokens", 4))


class _Step(nn.Module):
    """``batch -> model(**batch).loss`` (what the HF integrations profile)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict) -> torch.Tensor:
        return self.model(**batch).loss


def test_planner_chunks_the_head_only_when_the_budget_needs_it() -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=8000, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).train()
    step = _Step(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _batch()
    batch["labels"] = batch["labels"] % 8000
    batch["input_ids"] = batch["input_ids"] % 8000
    step_fn: Callable = lambda out, _t: out  # noqa: E731
    profile = profile_step(step, batch, None, step_fn, opt, keep_output=False)
    chunked = below_profiles(
        step, batch, None, step_fn, opt, profile=profile, tokens=BATCH * SEQ, seq_len=SEQ,
        keep_output=False,
    )  # fmt: skip
    modes = [(p.head.mode, p.head.vocab_rows > 0) for p in chunked if p.head]
    assert modes == [("grad-in-forward", False), ("recompute", False), ("recompute", True)]
    plain = min_peak_bytes(profile)["offload"]
    lowest = min_peak_bytes(profile, chunked=chunked)["offload"]
    assert lowest < plain
    assert make_plan(profile, budget_bytes=plain, strategy="offload", chunked=chunked).head is None
    tight = make_plan(profile, budget_bytes=lowest, strategy="offload", chunked=chunked)
    assert tight.head is not None and tight.head.fqn == "model.lm_head"
    assert head_chunking(step, tokens=BATCH * SEQ, mode="recompute") == HeadChunking(
        "model.lm_head", BATCH * SEQ, "recompute", "native" if _native() else "pure"
    )
    # the plan runs what it predicted, to the byte (the step as profiled, fresh model state)
    planned = copy.deepcopy(step)
    opt2 = torch.optim.AdamW(planned.parameters(), lr=1e-3)
    with apply_plan(planned, tight):
        planned(batch).backward()  # warm-up: AdamW's state exists from now on
        opt2.step()
        opt2.zero_grad(set_to_none=True)

        def one() -> None:
            planned(batch).backward()
            opt2.step()
            opt2.zero_grad(set_to_none=True)

        def resident() -> list[torch.Tensor]:
            state = [t for s in opt2.state.values() for t in s.values() if torch.is_tensor(t)]
            return [*planned.parameters(), *planned.buffers(), *state, *batch.values()]

        measured = allocator_peak_bytes(one, resident=resident)
    # exact up to the stated margin for what the allocator serves outside any op
    predicted = tight.predicted_peak_bytes
    assert predicted - ALLOCATOR_MARGIN_BYTES <= measured <= predicted


def _native() -> bool:
    from superneurons.memory.chunked import headloss

    return headloss.native_linear_cross_entropy() is not None
