"""Optimizer state in the host pool (memory.offload.optim_host) for optimizer-in-backward: updates
equal the device-state path bitwise, state_dict round trip, every device byte back at the end of the
step, and the planner's predicted peak equal to the executed one."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory import Plan, UnitDecision, apply_plan, make_plan, min_peak_bytes
from superneurons.memory.offload.optim_host import MIN_STATE_OFFLOAD_BYTES, HostOptimizerState
from superneurons.memory.profiling.step import profile_step
from superneurons.memory.sizing.simulate import simulate_plan

Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Factory] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01),
}


def _net() -> nn.Module:
    """Two convolutions and a linear head with state above the offload threshold, plus small
    parameters (biases, BatchNorm) whose state stays on the device."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU()),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    )


UNITS = (UnitDecision("0", "keep"), UnitDecision("1", "offload"), UnitDecision("3", "keep"))


def _plan(*, on_host: bool) -> Plan:
    strategy = "offload+opt-on-host" if on_host else "offload+opt-in-backward"
    return Plan(
        units=UNITS,
        strategy=strategy,
        budget_bytes=1 << 30,
        optimizer_in_backward=True,
        optimizer_on_host=on_host,
    )


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g))
        for _ in range(steps)
    ]


def _managed(handle: object) -> list[torch.Tensor]:
    """The state tensors the host pool holds (storage inside its slab)."""
    state = handle.host_state  # type: ignore[attr-defined]
    slabs = {b.untyped_storage().data_ptr() for b in state.host_buffers()}
    return [
        t
        for opt in handle.optimizers.values()  # type: ignore[attr-defined]
        for per_param in opt.state.values()
        for t in per_param.values()
        if torch.is_tensor(t) and t.untyped_storage().data_ptr() in slabs
    ]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_updates_equal_device_state_bitwise(name: str) -> None:
    factory = OPTIMIZERS[name]
    ref, ours = _net(), _net()
    with (
        apply_plan(ref, _plan(on_host=False), optimizer_factory=factory) as h_ref,
        apply_plan(ours, _plan(on_host=True), optimizer_factory=factory) as h_ours,
    ):
        for x, y in _batches(4):
            F.cross_entropy(ref(x), y).backward()
            F.cross_entropy(ours(x), y).backward()
        for (key, a), (_, b) in zip(
            ref.state_dict().items(), ours.state_dict().items(), strict=True
        ):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=key)
        sd_ref, sd_ours = h_ref.state_dict(), h_ours.state_dict()
        for fqn, opt_state in sd_ref["optimizers"].items():
            for key, a in opt_state["state"][0].items():
                b = sd_ours["optimizers"][fqn]["state"][0][key]
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{fqn}.{key}")
        # the large parameters' state is in the host slab, the small ones' is not
        large = [p for p in ours.parameters() if p.numel() * 4 >= MIN_STATE_OFFLOAD_BYTES]
        per_param = {"sgd": 1, "adamw": 2}[name]
        assert len(large) == 2 and len(_managed(h_ours)) == per_param * len(large)


def test_every_device_byte_returns_at_the_end_of_the_step() -> None:
    model = _net()
    with apply_plan(model, _plan(on_host=True), optimizer_factory=OPTIMIZERS["sgd"]) as handle:
        assert handle.host_state is not None
        previous = handle.host_state.stats()
        for step, (x, y) in enumerate(_batches(3)):
            F.cross_entropy(model(x), y).backward()
            stats = handle.host_state.stats()
            assert stats.device_bytes == 0  # nothing of the host-held state left on the device
            out = stats.d2h_bytes - previous.d2h_bytes
            back = stats.h2d_bytes - previous.h2d_bytes
            assert out == stats.host_bytes  # every state byte went back to the host
            assert back == (stats.host_bytes if step else 0)  # ... after coming in for the step
            # one ahead: at most one fetch per step on demand (the first of backward)
            assert stats.demand_fetches - previous.demand_fetches <= 1
            assert stats.peak_device_bytes < stats.host_bytes  # never all of it at once
            previous = stats
        assert stats.prefetch_hits >= 2
        assert all(p.grad is None for p in model.parameters())


def test_state_dict_round_trip_continues_identically() -> None:
    factory = OPTIMIZERS["adamw"]
    batches = _batches(4)
    model = _net()
    with apply_plan(model, _plan(on_host=True), optimizer_factory=factory) as handle:
        for x, y in batches[:2]:
            F.cross_entropy(model(x), y).backward()
        saved_model = copy.deepcopy(model.state_dict())
        saved = copy.deepcopy(handle.state_dict())
        for x, y in batches[2:]:
            F.cross_entropy(model(x), y).backward()
    resumed = _net()
    resumed.load_state_dict(saved_model)
    with apply_plan(resumed, _plan(on_host=True), optimizer_factory=factory) as handle:
        handle.load_state_dict(saved)
        assert handle.host_state is not None
        # loading casts state to the parameter's device: it is moved back into the host pool
        assert handle.host_state.stats().device_bytes == 0
        assert len(_managed(handle)) == 2 * 2  # AdamW: two moments of two parameters
        for x, y in batches[2:]:
            F.cross_entropy(resumed(x), y).backward()
    for (key, a), (_, b) in zip(
        model.state_dict().items(), resumed.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=key)


def test_planner_puts_state_on_host_and_simulation_executes_the_predicted_peak() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _batches(1)[0]
    profile = profile_step(model, x, y, F.cross_entropy, opt, fake=True)
    minima = min_peak_bytes(profile)
    assert minima["offload+opt-on-host"] < minima["offload+opt-in-backward"]
    plan = make_plan(
        profile, budget_bytes=minima["offload+opt-on-host"], strategy="offload+opt-on-host"
    )
    assert plan.optimizer_on_host and plan.optimizer_in_backward
    large = sum(p.numel() * 4 for p in model.parameters() if p.numel() * 4 >= 16 * 1024)
    assert plan.optimizer_host_bytes == large  # SGD momentum: one parameter-sized buffer each
    assert plan.optimizer_copy_s > 0
    assert Plan.from_json(plan.to_json()) == plan
    executed = simulate_plan(model, x, y, F.cross_entropy, opt, plan).measured_peak_bytes
    assert executed == plan.predicted_peak_bytes
    # the planner decides: no host state where the budget does not need it, and ``auto``
    # moves it only when nothing on the device fits
    roomy = make_plan(
        profile, budget_bytes=profile.predicted_peak_bytes(), strategy="offload+opt-on-host"
    )
    assert not roomy.optimizer_on_host and roomy.optimizer_host_bytes == 0
    auto = make_plan(profile, budget_bytes=minima["offload+opt-in-backward"])
    assert not auto.optimizer_on_host
    auto = make_plan(profile, budget_bytes=minima["offload+opt-on-host"])
    assert auto.optimizer_on_host and auto.strategy == "offload+opt-on-host"


ZOO = [
    (
        "resnet",
        {"layers": (1, 1, 1, 1), "width": 8, "small_input": True},
        {"image_size": 16},
        "sgd",
    ),
    (
        "gpt",
        {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64, "vocab_size": 512},
        {},
        "adamw",
    ),
]


@pytest.mark.parametrize(("name", "kwargs", "extra", "optimizer"), ZOO, ids=["resnet", "gpt"])
def test_zoo_host_state_plans_execute_their_predicted_peak(
    name: str, kwargs: dict, extra: dict, optimizer: str
) -> None:
    """From the strategy's floor to halfway to eager: peak <= budget, predicted within 1% above
    executed (AdamW: two moments on the host, its step counters stay)."""
    from superneurons.models.zoo import build_model, default_loss, model_input

    model = build_model(name, **kwargs)
    opt = OPTIMIZERS[optimizer](list(model.parameters()))
    x, y = model_input(name, 2, **kwargs, **extra)
    loss_fn = default_loss(name)
    profile = profile_step(model, x, y, loss_fn, opt, fake=True)
    floor, eager = min_peak_bytes(profile)["offload+opt-on-host"], profile.predicted_peak_bytes()
    for budget in sorted({floor, (floor + eager) // 2}):
        plan = make_plan(profile, budget_bytes=budget, strategy="offload+opt-on-host")
        assert plan.optimizer_on_host
        executed = simulate_plan(model, x, y, loss_fn, opt, plan).measured_peak_bytes
        # the model bounds the state on the device by the largest of the parameters whose
        # gradients one op makes (their hooks run one after the other): never below executed
        assert executed <= plan.predicted_peak_bytes <= budget
        assert plan.predicted_peak_bytes <= 1.01 * executed


def test_host_state_without_optimizer_in_backward_is_refused() -> None:
    with pytest.raises(ConfigError, match="optimizer_in_backward"):
        Plan(units=UNITS, strategy="offload", budget_bytes=1, optimizer_on_host=True)


@pytest.mark.cuda
def test_cuda_state_is_pinned_and_copies_run_on_side_streams() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    factory = OPTIMIZERS["sgd"]
    ref, ours = _net().cuda(), _net().cuda()
    with (
        apply_plan(ref, _plan(on_host=False), optimizer_factory=factory),
        apply_plan(ours, _plan(on_host=True), optimizer_factory=factory) as handle,
    ):
        for x, y in _batches(3):
            x, y = x.cuda(), y.cuda()
            F.cross_entropy(ref(x), y).backward()
            before = torch.cuda.memory_allocated()
            F.cross_entropy(ours(x), y).backward()
            assert torch.cuda.memory_allocated() <= before  # no state left on the device
        assert handle.host_state is not None
        handle.host_state.wait()
        managed = _managed(handle)
        assert managed and all(t.is_pinned() and t.device.type == "cpu" for t in managed)
        for (key, a), (_, b) in zip(
            ref.state_dict().items(), ours.state_dict().items(), strict=True
        ):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=key)


def test_host_state_counts_nothing_before_a_step() -> None:
    state = HostOptimizerState(device="cpu")
    stats = state.stats()
    assert stats.host_bytes == stats.device_bytes == stats.params == 0
