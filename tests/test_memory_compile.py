"""``torch.compile`` over a plan: the runtime's hooks add no graph break of their own (no
``_cdata``, no dynamo-skipped call such as ``set_checkpoint_early_stop``, no logging in traced
code). Offload units (the tensor pool's saved-tensor hooks) are not traceable: dynamo runs them
eagerly between graphs.

Dynamo's own ``eager`` backend is enough to count graph breaks (no code generation)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from superneurons.memory import apply_plan, make_plan
from superneurons.memory.plan import Plan, UnitDecision
from superneurons.memory.profile import output_loss, profile_step

transformers = pytest.importorskip("transformers")


def _model_and_batch() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=172, vocab_size=512, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def _graph_breaks(model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, int]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.compile(model, backend="eager")(**batch).loss.backward()
    return dict(counters["graph_break"])


def _all(profile: Any, action: str) -> Plan:
    plan = make_plan(profile, budget_bytes=profile.predicted_peak_bytes(), strategy="eager")
    return Plan(
        units=tuple(UnitDecision(u.fqn, action) for u in plan.units),
        strategy="checkpoint" if action == "recompute" else "offload",
        budget_bytes=plan.budget_bytes,
    )


def test_a_recompute_plan_adds_no_graph_break() -> None:
    model, batch = _model_and_batch()
    baseline = _graph_breaks(model, batch)
    profile = profile_step(model, batch, None, output_loss, None, keep_output=False)
    with apply_plan(model, _all(profile, "recompute")):
        planned = _graph_breaks(model, batch)
    assert planned == baseline, planned
