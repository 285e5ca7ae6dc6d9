"""Plans that step the optimizer in backward, below the largest layer, hold their budget.

A recompute plan's checkpoint keeps what each unit was called with; HF's decoder layers take
``position_ids`` (``(1, T)`` int64) as a keyword argument that autograd never saves, so a
checkpointed layer keeps ``8 T`` bytes alive into backward that no saved tensor accounts for.
The planner counts them (``Profile.unsaved_inputs``): on a tiny Llama with the LM head in
chunks, the optimizer-in-backward and host-optimizer plans at their reported minimum run at
exactly the predicted peak (live storages), never above the budget.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from superneurons.bench.memory.meter import device_peak_bytes
from superneurons.memory import apply_plan, make_plan, min_peak_bytes, profile_step
from superneurons.memory.profiling.below import below_profiles

transformers = pytest.importorskip("transformers")

BATCH, SEQ, VOCAB = 2, 128, 8192


class _Step(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**inputs).loss


def _step() -> _Step:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    return _Step(transformers.LlamaForCausalLM(config).train())


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def _loss_is_output(out: torch.Tensor, _targets: Any) -> torch.Tensor:
    return out


@pytest.mark.parametrize("strategy", ["offload+opt-in-backward", "offload+host-optimizer"])
def test_plan_at_its_floor_runs_at_the_predicted_peak(strategy: str) -> None:
    torch.set_num_threads(1)
    step, batch = _step(), _batch()
    options: dict[str, Any] = dict(fake=True, keep_output=False)
    plain = profile_step(step, batch, None, _loss_is_output, _adamw(step.parameters()), **options)
    chunked = below_profiles(
        step, batch, None, _loss_is_output, _adamw(step.parameters()), profile=plain,
        tokens=BATCH * SEQ, seq_len=SEQ, **options,
    )  # fmt: skip
    floor = min_peak_bytes(plain, chunked=chunked)[strategy]
    plan = make_plan(plain, budget_bytes=floor, strategy=strategy, chunked=chunked)
    assert plan.head is not None  # below the largest layer: the head + loss in chunks
    assert any(u.action != "keep" for u in plan.units)  # checkpoints hold the layers' inputs
    handle = apply_plan(step, plan, optimizer_factory=_adamw)
    in_backward = list(handle.optimizers.values()) if handle.optimizers else []

    def one() -> None:
        step(batch).backward()
        if handle.optimizer is not None:  # the host optimizer: its state is in the host pool
            handle.optimizer.step()
            handle.optimizer.zero_grad(set_to_none=True)

    one()  # the optimizer state exists from now on
    state = [t for o in in_backward for s in o.state.values() for t in s.values()]
    host = handle.pool.host_buffers()
    if handle.host_state is not None:
        host += handle.host_state.host_buffers()
    resident = [*step.parameters(), *step.buffers(), *state, *batch.values()]
    measured = device_peak_bytes(one, resident=resident, host=host)
    handle.remove()
    assert measured == plan.predicted_peak_bytes <= plan.budget_bytes
