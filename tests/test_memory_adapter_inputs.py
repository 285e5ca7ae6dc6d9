"""LoRA adapters keep their input at the base's precision (memory.chunked.adapter_inputs): PEFT
casts a bf16 layer input to the fp32 adapters' dtype and ``lora_A`` saves that copy; kept, the
input is saved as it came and cast again in backward. Loss and gradients bit for bit eager's,
the saved bytes down by at least the copies less their sources, only where PEFT casts, nothing
left behind by ``remove()`` or a refusal; a plan carries it and runs at its predicted peak."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from adapters_support import IDS, Loop, llama_config
from superneurons.bench.memory.meter import allocator_peak_bytes
from superneurons.errors import ConfigError
from superneurons.integrations.hf import plan_for_batch
from superneurons.memory import InfeasibleBudgetError, apply_plan
from superneurons.memory.chunked.adapter_inputs import adapter_inputs, keep_adapter_inputs
from superneurons.memory.plan import Plan

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _model(dtype: torch.dtype = torch.bfloat16, dropout: float = 0.0, **options: Any) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(llama_config()).to(dtype)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=dropout)
    return peft.get_peft_model(base, config, **options).train()


def _grads(model: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, adapter gradients and the bytes of the distinct storages autograd saved (weights
    excluded) for one step on ``IDS``."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, sum(saved.values())


def test_kept_inputs_are_eager_bit_for_bit_and_save_the_fp32_copies() -> None:
    eager, kept = _model(), _model()
    fqns = adapter_inputs(kept)
    assert len(fqns) == 2 * len(LAYERS) and all(f.rsplit(".", 1)[-1] in LAYERS for f in fqns)
    loss, grads, saved = _grads(eager)
    handle = keep_adapter_inputs(kept, fqns)
    loss_kept, grads_kept, saved_kept = _grads(kept)
    handle.remove()
    assert torch.equal(loss_kept, loss)
    assert grads_kept.keys() == grads.keys() and len(grads) == 2 * 2 * len(LAYERS)
    for name, grad in grads.items():
        assert torch.equal(grads_kept[name], grad), name
    config = llama_config()
    hidden, wide, tokens = config.hidden_size, config.intermediate_size, IDS.numel()
    # per block: q, k, v, o, gate, up read hidden-wide inputs, down the MLP's; each adapter's
    # fp32 copy (4 B) goes; at most the distinct bf16 sources (2 B) come: the normed input read
    # by q, k and v, the attention's output, the normed input of gate and up, down's input
    copies = config.num_hidden_layers * tokens * 4 * (6 * hidden + wide)
    sources = config.num_hidden_layers * tokens * 2 * (3 * hidden + wide)
    assert saved - saved_kept >= copies - sources > 0
    for module in kept.modules():  # remove() put PEFT's casts and the adapters' forwards back
        if hasattr(module, "cast_input_dtype_enabled"):
            assert module.cast_input_dtype_enabled
            assert all("forward" not in a.__dict__ for a in module.lora_A.values())


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(lambda: _model(torch.float32), id="fp32-base"),
        pytest.param(lambda: _model(dropout=0.1), id="dropout"),
        pytest.param(lambda: _model(autocast_adapter_dtype=False), id="bf16-adapters"),
    ],
)
def test_only_where_peft_casts_and_nothing_else_reads_the_cast(model: Any) -> None:
    built = model()
    assert adapter_inputs(built) == ()
    layer = next(f for f, m in built.named_modules() if hasattr(m, "cast_input_dtype_enabled"))
    with pytest.raises(ConfigError, match="re-plan"):
        keep_adapter_inputs(built, [layer])
    with pytest.raises(ConfigError, match="does not have"):
        keep_adapter_inputs(built, ["base_model.model.model.layers.9.self_attn.q_proj"])
    assert all(  # a refusal leaves no trace
        m.cast_input_dtype_enabled
        for m in built.modules()
        if hasattr(m, "cast_input_dtype_enabled")
    )


def test_a_plan_keeps_them_runs_at_its_peak_and_trains_as_eager() -> None:
    loop = Loop(_model())
    loop.step()  # AdamW's moments exist, as in the profiled steady state
    with pytest.raises(InfeasibleBudgetError) as info:
        plan_for_batch(loop.model, loop.batch, budget_bytes=1, optimizer=loop.opt)
    floor = info.value.min_budget_bytes
    plan = plan_for_batch(loop.model, loop.batch, budget_bytes=floor, optimizer=loop.opt)
    assert plan.adapter_inputs == adapter_inputs(loop.model)
    assert Plan.from_dict(plan.to_dict()) == plan
    plain = Plan.from_dict({k: v for k, v in plan.to_dict().items() if k != "adapter_inputs"})
    assert "adapter_inputs" not in plain.to_dict()  # a plan without them reads as before
    with apply_plan(loop.model, plan):
        loop.step()
        peak = allocator_peak_bytes(loop.step, resident=loop.resident)
    assert peak <= floor, f"measured {peak} B at the floor {floor} B"
    assert abs(peak - plan.predicted_peak_bytes) <= 0.01 * peak
    twin = Loop(_model())
    for _ in range(loop.count):
        twin.step()
    for (name, a), b in zip(twin.model.named_parameters(), loop.model.parameters(), strict=True):
        assert torch.equal(a, b), f"{name} differs from eager"
    for got, expected in zip(loop.losses, twin.losses, strict=True):
        assert abs(got - expected) <= 1e-6 * abs(expected)  # the head's loss, chunk by chunk
    layer = loop.model.get_submodule(plan.adapter_inputs[0])
    assert layer.cast_input_dtype_enabled  # the handle's exit gave PEFT its cast back
