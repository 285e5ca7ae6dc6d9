"""``torch.compile`` over a plan (:mod:`superneurons.memory.runtime.compiled`).

By default a compiled call of a planned model, or of one of its units compiled alone, is refused
with a ``ConfigError`` at its first call (the budget holds for the eager step the plan was
profiled from), and the planned model still runs eagerly within its budget, measured in the c10
allocator's view. With ``apply_plan(..., compile="trace")`` the runtime's hooks add no graph
break of their own (no ``_cdata``, no dynamo-skipped call such as ``set_checkpoint_early_stop``,
no logging in traced code) and the traced recompute gives eager's gradients within the
eager-vs-compile tolerance. Offload units (the tensor pool's saved-tensor hooks) are not
traceable: dynamo runs them eagerly between graphs.

Dynamo's own ``eager`` backend is enough to count graph breaks (no code generation); the
refusal comes before inductor compiles anything, so the inductor cases take seconds.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from superneurons.bench.memory.meter import allocator_peak_bytes
from superneurons.errors import ConfigError
from superneurons.memory import apply_plan, make_plan
from superneurons.memory.plan import Plan, UnitDecision
from superneurons.memory.planner.decide import strategy_floors
from superneurons.memory.profiling.step import output_loss, profile_step
from superneurons.memory.runtime.compiled import refusal_message

transformers = pytest.importorskip("transformers")


def _model_and_batch(layers: int = 2, seq_len: int = 64, batch: int = 2) -> tuple[nn.Module, Any]:
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=172, vocab_size=512, max_position_embeddings=seq_len, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 512, (batch, seq_len), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def _graph_breaks(model: nn.Module, batch: dict[str, Any]) -> dict[str, int]:
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


def test_a_recompute_plan_traced_adds_no_graph_break() -> None:
    model, batch = _model_and_batch()
    baseline = _graph_breaks(model, batch)
    profile = profile_step(model, batch, None, output_loss, None, keep_output=False)
    with apply_plan(model, _all(profile, "recompute"), compile="trace"):
        planned = _graph_breaks(model, batch)
    assert planned == baseline, planned


def test_a_compiled_call_is_refused_and_the_plan_holds_eagerly() -> None:
    """The tiny Llama of the budget matrix (fp32, AdamW) at the reported minimum: inductor's
    compiled call is refused with the exact message; the same model then steps eagerly under
    the plan, its peak in the c10 allocator's view within the budget."""
    model, batch = _model_and_batch(layers=3, seq_len=128, batch=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(call: Any) -> None:
        call(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(model)
    profile = profile_step(model, batch, None, output_loss, opt, keep_output=False)
    budget = strategy_floors(profile)["recompute"].min_budget_bytes
    plan = make_plan(profile, budget_bytes=budget, strategy="recompute")
    before = [p.detach().clone() for p in model.parameters()]
    torch._dynamo.reset()
    with apply_plan(model, plan):
        compiled = torch.compile(model)  # inductor
        with pytest.raises(ConfigError) as refused:
            step(compiled)
        assert str(refused.value) == refusal_message("model")
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert all(p.grad is None for p in model.parameters())  # nothing ran
        step(model)
        state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        resident = lambda: [*model.parameters(), *state, batch["input_ids"]]  # noqa: E731
        assert allocator_peak_bytes(lambda: step(model), resident=resident) <= budget
    torch._dynamo.reset()


def test_a_unit_compiled_alone_and_fullgraph_are_refused() -> None:
    model, batch = _model_and_batch()
    profile = profile_step(model, batch, None, output_loss, None, keep_output=False)
    torch._dynamo.reset()
    with apply_plan(model, _all(profile, "recompute")):
        with pytest.raises(Exception, match="running a memory plan") as refused:
            torch.compile(model, backend="eager", fullgraph=True)(**batch)
        # fullgraph: dynamo's own error for the graph break, our message as its reason
        assert refusal_message() in str(refused.value)
        layer = model.get_submodule("model.layers.1")
        layer.compile(backend="eager")
        with pytest.raises(ConfigError) as refused_unit:
            model(**batch)
        assert str(refused_unit.value) == refusal_message("model.layers.1")
    del layer._compiled_call_impl  # what nn.Module.compile() set
    torch._dynamo.reset()
    model(**batch).loss.backward()  # plan removed: the model runs as before


def test_compile_mode_is_validated() -> None:
    model, batch = _model_and_batch(layers=1)
    profile = profile_step(model, batch, None, output_loss, None, keep_output=False)
    with pytest.raises(ConfigError, match="compile must be one of"):
        apply_plan(model, _all(profile, "recompute"), compile="auto")  # type: ignore[arg-type]


@pytest.mark.slow  # AOTAutograd traces forward and backward, then partitions them
def test_traced_recompute_gradients_equal_eager_within_compile_tolerance() -> None:
    """The traced checkpoint under AOTAutograd's min-cut partitioner (the one inductor uses;
    no code generation): gradients as far from eager's as the unplanned compiled model's."""
    model, batch = _model_and_batch()

    def grads(call: Any) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        call(**batch).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    eager = grads(model)
    backend = "aot_eager_decomp_partition"
    torch._dynamo.reset()
    plain = grads(torch.compile(model, backend=backend))
    profile = profile_step(model, batch, None, output_loss, None, keep_output=False)
    torch._dynamo.reset()
    with apply_plan(model, _all(profile, "recompute"), compile="trace"):
        traced = grads(torch.compile(model, backend=backend))
    torch._dynamo.reset()
    assert len(traced) == len(eager)
    for e, p, t in zip(eager, plain, traced, strict=True):
        tolerance = max((p - e).abs().max().item(), 1e-6)
        assert (t - e).abs().max().item() <= 4 * tolerance


class _ConvBN(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())


def test_a_traced_recompute_unit_with_batchnorm_is_refused() -> None:
    """A raise in traced code would make dynamo rerun the frame eagerly: the refusal must
    surface as the ConfigError itself."""
    model = nn.Sequential(_ConvBN(), _ConvBN()).train()
    units = (UnitDecision("0", "recompute"), UnitDecision("1", "keep"))
    plan = Plan(units=units, strategy="checkpoint", budget_bytes=1 << 30)
    torch._dynamo.reset()
    refused = pytest.raises(ConfigError, match="BatchNorm layers cannot run under torch.compile")
    with apply_plan(model, plan, compile="trace"), refused:
        torch.compile(model, backend="eager")(torch.randn(2, 3, 12, 12))
    torch._dynamo.reset()
