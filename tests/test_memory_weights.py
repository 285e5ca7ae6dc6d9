"""Weights streamed through the host pool (memory.offload.weights, memory.planner.weights): values,
gradients and optimizer state bitwise equal to eager over 5 steps, with tied embeddings, a module
called twice, frozen and trainable parameters and LoRA on a frozen base; checkpoint round trip and
resume; reads of a parameter outside its unit's window; the plan format; the planner streaming
nothing when the budget allows and the cheapest units first when not; and on a tiny Llama
(vocabulary 32000) the measured peak against the prediction."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory import Plan, UnitDecision, apply_plan, make_plan, profile_step
from superneurons.memory.planner.decide import search_floors
from superneurons.memory.planner.weights import stream_order


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


class _Net(nn.Module):
    """An embedding and a head that may share their weight, blocks in a ModuleList, one block
    called twice in a forward."""

    def __init__(self, *, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3)
        )
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 50, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # (B, T, 32)
        for block in self.blocks:
            h = h + block(h)
        h = h + self.blocks[1](h)  # called twice
        return self.head(self.norm(h))  # (B, T, 50)


def _net(**kwargs: Any) -> _Net:
    torch.manual_seed(0)
    return _Net(**kwargs)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, 50, (4, 8), generator=gen), torch.randint(0, 50, (4, 8), generator=gen)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    ids, targets = _batch(step)
    return F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())


_UNITS = ("embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head")


def _plan(streamed: tuple[str, ...], actions: dict[str, str] | None = None) -> Plan:
    actions = actions or {}
    units = tuple(
        UnitDecision(f, actions.get(f, "keep"), weights="host" if f in streamed else "device")
        for f in _UNITS
    )
    return Plan(units=units, strategy="stream-weights", budget_bytes=1 << 30, host_optimizer=True)


def _train_both(eager: nn.Module, ours: nn.Module, plan: Plan, steps: int = 5) -> Any:
    trainable = [p for p in eager.parameters() if p.requires_grad]
    opt = _adamw(trainable)
    handle = apply_plan(ours, plan, optimizer_factory=_adamw)
    assert handle.optimizer is not None
    for step in range(steps):
        opt.zero_grad()
        _loss(eager, step).backward()
        opt.step()
        _loss(ours, step).backward()
        handle.optimizer.step()
    return opt, handle


def _assert_equal(eager: nn.Module, ours: nn.Module) -> None:
    for (fqn, a), b in zip(eager.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(a, b), fqn


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_streamed_training_equals_eager_bitwise(tied: bool) -> None:
    eager, ours = _net(tied=tied), _net(tied=tied)
    actions = {"blocks.0": "recompute", "blocks.2": "offload", "norm": "recompute+offload"}
    plan = _plan(("embed", "blocks.0", "blocks.1", "head", "norm"), actions)
    opt, handle = _train_both(eager, ours, plan)
    stream = handle.weights
    assert stream is not None
    # a tied weight streams once, with both units; blocks.2 stays on the device
    names = {w.fqn for w in stream.weights}
    assert "blocks.2.0.weight" not in names and ("head.weight" in names) is not tied
    assert stream.stats().device_bytes == 0  # nothing left on the device between steps
    # values, and the optimizer state: the host masters' moments equal eager's
    _assert_equal(eager, ours)
    host = handle.optimizer.state_dict()  # type: ignore[union-attr]
    by_name = dict(zip(host["masters"], host["optimizer"]["state"].values(), strict=True))
    for fqn, param in eager.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[param][key], by_name[fqn][key]), (fqn, key)
    handle.remove()
    _assert_equal(eager, ours)  # the parameters back where they were, same values


def test_gradients_equal_eager_with_frozen_and_trainable_streamed_weights() -> None:
    eager, ours = _net(), _net()
    for model in (eager, ours):
        model.blocks[0].requires_grad_(False)  # frozen: streams with no gradient
    plan = _plan(("blocks.0", "blocks.1", "head"))
    _train_both(eager, ours, plan)
    _assert_equal(eager, ours)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-base"])
def test_lora_on_a_frozen_streamed_base_equals_eager(dtype: torch.dtype) -> None:
    """On a bf16 base the fp32 adapters also keep their input at the base's precision."""
    peft = pytest.importorskip("peft")
    from superneurons.memory.chunked.adapter_inputs import adapter_inputs

    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=r".*blocks\.\d\.(0|2)", lora_dropout=0.0
    )

    def lora() -> nn.Module:
        torch.manual_seed(0)
        return peft.get_peft_model(_Net().to(dtype), config)

    eager, ours = lora(), lora()
    prefix = "base_model.model."
    units = tuple(
        UnitDecision(prefix + f, "keep", weights="host" if f.startswith("blocks") else "device")
        for f in _UNITS
    )
    kept = adapter_inputs(ours)
    assert bool(kept) == (dtype == torch.bfloat16)
    plan = Plan(
        units=units, strategy="stream-weights", budget_bytes=1 << 30, host_optimizer=True,
        adapter_inputs=kept,
    )  # fmt: skip
    base = {n: p.detach().clone() for n, p in ours.named_parameters() if not p.requires_grad}
    _, handle = _train_both(eager, ours, plan)
    assert handle.weights is not None and any(
        not w.param.requires_grad for w in handle.weights.weights
    )
    _assert_equal(eager, ours)
    for fqn, param in ours.named_parameters():
        if fqn in base:
            assert torch.equal(param, base[fqn]), fqn  # the frozen base is untouched


def test_checkpoint_round_trip_resumes_bitwise() -> None:
    plan = _plan(("embed", "blocks.1", "head"), {"blocks.1": "recompute"})
    model = _net()
    handle = apply_plan(model, plan, optimizer_factory=_adamw)
    for step in range(2):
        _loss(model, step).backward()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "plan": handle.state_dict()}, buffer)
    for step in range(2, 5):
        _loss(model, step).backward()
    handle.remove()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed = _net()
    resumed.load_state_dict(saved["model"])
    with apply_plan(resumed, plan, optimizer_factory=_adamw) as again:
        again.load_state_dict(saved["plan"])
        for step in range(2, 5):
            _loss(resumed, step).backward()
    _assert_equal(model, resumed)


def test_a_parameter_read_or_written_outside_its_window_is_current() -> None:
    eager, ours = _net(), _net()
    opt = _adamw(list(eager.parameters()))
    with apply_plan(ours, _plan(("blocks.1", "head")), optimizer_factory=_adamw) as handle:
        seen: list[torch.Tensor] = []
        # read mid-step: inside another unit's forward, the head's window is closed
        hook = ours.blocks[2].register_forward_hook(
            lambda *_: seen.append(ours.head.weight.detach().clone())
        )
        for step in range(2):
            opt.zero_grad()
            _loss(eager, step).backward()
            _loss(ours, step).backward()
            assert torch.equal(seen[-1], eager.head.weight)  # the step before this one's
            opt.step()
            assert torch.equal(ours.head.weight, eager.head.weight)  # read after the step
        hook.remove()
        # a write from outside between steps reaches the host optimizer's masters and the device
        with torch.no_grad():
            ours.head.weight.mul_(0.5)
            eager.head.weight.mul_(0.5)
        opt.zero_grad()
        _loss(eager, 2).backward()
        opt.step()
        _loss(ours, 2).backward()
        assert handle.weights is not None
    _assert_equal(eager, ours)


def test_refusals() -> None:
    model = _net()
    plan = Plan(
        units=(UnitDecision("blocks.0", "keep", weights="host"),),
        strategy="stream-weights",
        budget_bytes=1 << 30,
    )
    with pytest.raises(ConfigError, match="host optimizer|host \\(plan.host_optimizer\\)"):
        apply_plan(model, plan)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert "forward" not in model.blocks[0].__dict__  # no trace left on the model
    with pytest.raises(ConfigError, match="version 4"):
        Plan(units=plan.units, strategy="stream-weights", budget_bytes=1, version=3)
    with pytest.raises(ConfigError, match="weights"):
        UnitDecision("blocks.0", "keep", weights="disk")


def test_int8_weights_never_stream_and_a_repacked_4bit_weight_is_refused() -> None:
    """LLM.int8() layers keep their int8 values and scales in a state of their own: the profile
    marks them unstreamable (the planner never streams them) and a hand-made plan is refused;
    a 4-bit weight bitsandbytes repacks for CPU inference inside its window is an error, not
    a host copy paired with the new layout."""
    bnb = pytest.importorskip("bitsandbytes")
    from superneurons.memory.profile_types import unit_params

    torch.manual_seed(0)
    int8 = bnb.nn.Linear8bitLt(32, 32, bias=False, has_fp16_weights=False, threshold=0.0)
    int8.weight = bnb.nn.Int8Params(torch.randn(32, 32), requires_grad=False,
                                    has_fp16_weights=False)  # fmt: skip
    model = nn.Sequential(nn.Linear(32, 32), int8.to("cpu"))
    records = {r.fqn: r for r in unit_params(model, ["0", "1"])}
    assert records["0.weight"].streamable and not records["1.weight"].streamable
    assert not records["1.weight.SCB"].streamable  # its scales, held beside the weight
    plan = Plan(
        units=(UnitDecision("0", "keep"), UnitDecision("1", "keep", weights="host")),
        strategy="stream-weights", budget_bytes=1 << 30, host_optimizer=True,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="LLM.int8"):
        apply_plan(model, plan, optimizer_factory=_adamw)
    assert "forward" not in model[1].__dict__  # no trace left on the model
    profile = profile_step(
        model, torch.randn(4, 32), None, lambda out, _: out.square().mean(),
        _adamw(list(model[0].parameters())), units=["0", "1"],
    )  # fmt: skip
    assert stream_order(profile, search_floors(profile).cost) == ["0"]  # the planner agrees

    four = bnb.nn.Linear4bit(32, 32, bias=False, quant_type="nf4", compute_dtype=torch.float32)
    four.weight = bnb.nn.Params4bit(torch.randn(32, 32), requires_grad=False, quant_type="nf4",
                                    module=four)  # fmt: skip
    model = nn.Sequential(nn.Linear(32, 32), four.to("cpu"))
    handle = apply_plan(model, plan, optimizer_factory=_adamw)
    model[1].register_forward_pre_hook(  # what Linear4bit.forward does in eval on AVX512-BF16
        lambda m, _: setattr(m.weight.quant_state, "packing_format_for_cpu", True)
    )
    with pytest.raises(ConfigError, match="repacked"):
        model(torch.randn(2, 32))
    handle.remove()


def test_plan_format_version_4_and_older_plans_read() -> None:
    plan = _plan(("blocks.1",))
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.streamed_units() == ["blocks.1"]
    old = _plan(())
    body = old.to_dict() | {"version": 3}
    for unit in body["units"]:
        del unit["weights"]
    for key in ("weights_host_bytes", "streamed_bytes", "weights_exposed_s", "exposed_transfer_s"):
        del body[key]
    read = Plan.from_dict(body)
    assert read.version == 3 and all(u.weights == "device" for u in read.units)
    assert read.to_dict() == body  # a version 3 record, key for key


# --- the planner -------------------------------------------------------------------------------
def _profile() -> Any:
    model = _net()
    ids, targets = _batch(0)

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    return profile_step(model, ids, targets, loss, _adamw(list(model.parameters())), fake=True)


def test_planner_streams_only_when_the_budget_needs_it_and_the_cheapest_first() -> None:
    profile = _profile()
    floors = search_floors(profile)
    peaks = floors.peak_bytes()
    host_floor, stream_floor = peaks["offload+host-optimizer"], peaks["stream-weights"]
    assert stream_floor < host_floor
    roomy = make_plan(profile, budget_bytes=host_floor, strategy="stream-weights")
    assert not roomy.streams_weights and roomy.version == 3  # nothing streams
    auto = make_plan(profile, budget_bytes=host_floor)
    assert auto.strategy != "stream-weights" and not auto.streams_weights
    tight = make_plan(profile, budget_bytes=stream_floor)
    assert tight.strategy == "stream-weights" and tight.streams_weights
    assert tight.predicted_peak_bytes <= stream_floor and tight.version == 4
    order = stream_order(profile, floors.cost)
    streamed = tight.streamed_units()
    # the streamed units are a prefix of the cost order: the cheapest copies first
    assert streamed and set(streamed) == set(order[: len(streamed)])
    # just below the host optimizer's floor, fewer units stream than at the floor
    between = make_plan(profile, budget_bytes=host_floor - 1, strategy="stream-weights")
    assert 0 < len(between.streamed_units()) <= len(streamed)
    assert tight.weights_host_bytes > 0 and tight.streamed_bytes >= 2 * tight.weights_host_bytes
    with pytest.raises(ConfigError, match="FSDP2"):
        make_plan(profile, budget_bytes=stream_floor, strategy="stream-weights",
                  allow_weight_streaming=False)  # fmt: skip


# --- a tiny Llama, measured ------------------------------------------------------------------
@pytest.mark.slow
def test_tiny_llama_streamed_plan_runs_at_its_predicted_peak() -> None:
    transformers = pytest.importorskip("transformers")
    from superneurons.bench.memory.meter import device_peak_bytes
    from superneurons.memory.profiling.below import below_profiles

    torch.set_num_threads(1)
    batch_size, seq, vocab = 1, 64, 32000

    class _Step(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.model(**inputs).loss

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=seq, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    step = _Step(transformers.LlamaForCausalLM(config).train())
    ids = torch.randint(0, vocab, (batch_size, seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    options: dict[str, Any] = dict(fake=False, keep_output=False)

    def loss(out: torch.Tensor, _targets: Any) -> torch.Tensor:
        return out

    plain = profile_step(step, batch, None, loss, _adamw(step.parameters()), **options)
    chunked = below_profiles(
        step, batch, None, loss, _adamw(step.parameters()), profile=plain,
        tokens=batch_size * seq, seq_len=seq, **options,
    )  # fmt: skip
    floors = search_floors(plain, chunked=chunked).peak_bytes()
    floor = floors["stream-weights"]
    assert floor < min(v for k, v in floors.items() if k != "stream-weights")
    plan = make_plan(plain, budget_bytes=floor, strategy="stream-weights", chunked=chunked)
    assert "model.model.embed_tokens" in plan.streamed_units()
    handle = apply_plan(step, plan, optimizer_factory=_adamw)
    assert handle.optimizer is not None and handle.weights is not None

    def one() -> None:
        step(batch).backward()
        handle.optimizer.step()  # type: ignore[union-attr]

    one()
    streamed = {id(w.param) for w in handle.weights.weights}
    resident = [p for p in step.parameters() if id(p) not in streamed]
    host = [*handle.pool.host_buffers(), *handle.weights.host_buffers()]
    measured = device_peak_bytes(one, resident=[*resident, *step.buffers(), ids], host=host)
    handle.remove()
    assert measured <= plan.budget_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.01 * plan.predicted_peak_bytes


@pytest.mark.cuda
def test_streaming_on_cuda_equals_the_resident_plan_bitwise() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    resident, streamed = _net().cuda(), _net().cuda()
    actions = {"blocks.0": "recompute", "blocks.2": "offload"}
    handles = [
        apply_plan(resident, _plan((), actions), optimizer_factory=_adamw),
        apply_plan(streamed, _plan(("embed", "blocks.0", "blocks.1", "head"), actions),
                   optimizer_factory=_adamw),
    ]  # fmt: skip
    for step in range(3):
        ids, targets = (t.cuda() for t in _batch(step))
        for model, handle in zip((resident, streamed), handles, strict=True):
            F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()
            handle.optimizer.step()  # type: ignore[union-attr]
    assert streamed.head.weight.device.type == "cpu"  # between steps: the pinned host copy
    assert streamed.head.weight.is_pinned()
    for handle in handles:
        handle.remove()
    _assert_equal(resident, streamed)
