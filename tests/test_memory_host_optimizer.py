"""The optimizer on the host (memory.offload.host_optimizer, memory.offload.host_buckets): bitwise
equal to the same optimizer on the device, alone and under DDP on 2 gloo ranks (with PyTorch's
default all-reduce and with a compression hook), checkpoint round trip, the buckets' device bytes as
predicted, and the planner taking it only when the budget needs it."""

from __future__ import annotations

import contextlib
import copy
import io
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed import Ranks, shared_ranks
from superneurons.errors import ConfigError
from superneurons.memory import (
    Plan,
    UnitDecision,
    apply_plan,
    make_plan,
    min_peak_bytes,
    profile_step,
    simulate_plan,
)
from superneurons.memory.plan import TrainingStep
from superneurons.memory.planner.buckets import assign_buckets, bucket_timeline

Factory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
# the reference runs the same implementation the host optimizer picks (fused on the host)
OPTIMIZERS: dict[str, Factory] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True),
}


class _Net(nn.Module):
    """Blocks in a ModuleList (units), a tied-free head, parameters of several sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(12, 32)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3)
        )
        self.head = nn.Linear(32, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)  # (B, 32)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)  # (B, 7)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, 12, generator=gen), torch.randint(0, 7, (16,), generator=gen)


def _plan(model: nn.Module, buckets: tuple[tuple[str, ...], ...] = ()) -> Plan:
    units = (UnitDecision("blocks.0", "recompute"), UnitDecision("blocks.1", "keep"))
    return Plan(
        units=units,
        strategy="offload+host-optimizer",
        budget_bytes=1 << 30,
        host_optimizer=True,
        grad_buckets=buckets,
    )


def _small_buckets(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """Reverse parameter order, two parameters a bucket: launches interleave with backward."""
    names = [fqn for fqn, _ in model.named_parameters()][::-1]
    return tuple(tuple(names[i : i + 2]) for i in range(0, len(names), 2))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_steps_equal_the_device_optimizer_bitwise(name: str) -> None:
    eager, ours = _net(), _net()
    opt = OPTIMIZERS[name](list(eager.parameters()))
    with apply_plan(
        ours, _plan(ours, _small_buckets(ours)), optimizer_factory=OPTIMIZERS[name]
    ) as h:
        assert h.optimizer is not None and h.buckets is not None
        for step in range(4):
            x, y = _batch(0, step)
            opt.zero_grad()
            F.cross_entropy(eager(x), y).backward()
            opt.step()
            h.optimizer.zero_grad()
            F.cross_entropy(ours(x), y).backward()
            h.optimizer.step()
            assert all(p.grad is None for p in ours.parameters())  # nothing left on the device
    for (fqn, a), b in zip(eager.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(a, b), fqn


def test_checkpoint_round_trip_continues_bitwise() -> None:
    factory = OPTIMIZERS["adamw"]
    model = _net()
    with apply_plan(model, _plan(model), optimizer_factory=factory) as handle:
        for step in range(2):
            F.cross_entropy(model(_batch(0, step)[0]), _batch(0, step)[1]).backward()
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "plan": handle.state_dict()}, buffer)
        for step in range(2, 4):
            F.cross_entropy(model(_batch(0, step)[0]), _batch(0, step)[1]).backward()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed = _net()
    resumed.load_state_dict(saved["model"])
    with apply_plan(resumed, _plan(resumed), optimizer_factory=factory) as handle:
        handle.load_state_dict(saved["plan"])
        for step in range(2, 4):
            F.cross_entropy(resumed(_batch(0, step)[0]), _batch(0, step)[1]).backward()
    for (fqn, a), b in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), fqn


def test_weights_loaded_after_the_plan_refresh_the_masters() -> None:
    factory = OPTIMIZERS["sgd"]
    source, model = _net(), _net()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    eager = copy.deepcopy(source)
    opt = factory(list(eager.parameters()))
    with apply_plan(model, _plan(model), optimizer_factory=factory):
        model.load_state_dict(source.state_dict())  # after the masters were made
        x, y = _batch(0, 0)
        F.cross_entropy(model(x), y).backward()
    F.cross_entropy(eager(x), y).backward()
    opt.step()
    for a, b in zip(eager.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bf16_parameters_keep_fp32_masters() -> None:
    model = _net().to(torch.bfloat16)
    reference = copy.deepcopy(model).float()  # the fp32 master trajectory, rounded each step
    factory = OPTIMIZERS["adamw"]
    opt = factory(list(reference.parameters()))
    with apply_plan(model, _plan(model), optimizer_factory=factory) as handle:
        assert handle.buckets is not None
        masters = handle.buckets.optimizer.masters
        assert all(m.dtype == torch.float32 for m in masters.values())
        x, y = _batch(0, 0)
        F.cross_entropy(model(x.bfloat16()), y).backward()
        F.cross_entropy(reference(x), y).backward()
    opt.step()
    for (fqn, master), p in zip(masters.items(), model.parameters(), strict=True):
        assert torch.equal(p, master.to(torch.bfloat16)), fqn  # the parameter is the master
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters.values())  # fp32 kept


# --- the planner -------------------------------------------------------------------------------
def _profile() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor, object]:
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch(0, 0)
    return model, opt, x, y, profile_step(model, x, y, F.cross_entropy, opt, fake=True)


def test_planner_takes_the_host_optimizer_only_when_the_budget_needs_it() -> None:
    model, opt, x, y, profile = _profile()
    minima = min_peak_bytes(profile)
    host = minima["offload+host-optimizer"]
    # the device's strategies (stream-weights runs the host optimizer too, its weights on the host)
    device = {
        k: v for k, v in minima.items() if k not in ("offload+host-optimizer", "stream-weights")
    }
    device_floor = min(device.values())
    assert host < device_floor
    roomy = make_plan(profile, budget_bytes=device_floor)
    assert not roomy.host_optimizer and roomy.grad_buckets == ()
    tight = make_plan(profile, budget_bytes=host)
    assert tight.host_optimizer and tight.strategy == "offload+host-optimizer"
    # DDP: optimizer-in-backward excluded, the host optimizer still allowed (it steps after
    # each bucket's all-reduce)
    ddp = make_plan(profile, budget_bytes=host, allow_optimizer_in_backward=False)
    assert ddp.host_optimizer and not ddp.optimizer_in_backward
    assert Plan.from_json(tight.to_json()) == tight
    # every trainable parameter is in one bucket, in the order gradients are born
    assert sorted(f for b in tight.grad_buckets for f in b) == sorted(
        f for f, _ in model.named_parameters()
    )
    # fp32 masters + AdamW's two fp32 moments (+ its step counters) per element
    numel = sum(p.numel() for p in model.parameters())
    assert 12 * numel <= tight.optimizer_host_bytes <= 12 * numel + 4 * 16


def test_simulated_peak_of_host_optimizer_plans_is_bounded_by_the_prediction() -> None:
    model, opt, x, y, profile = _profile()
    floor, eager = min_peak_bytes(profile)["offload+host-optimizer"], profile.predicted_peak_bytes()
    for budget in sorted({floor, (floor + eager) // 2}):
        plan = make_plan(profile, budget_bytes=budget, strategy="offload+host-optimizer")
        executed = simulate_plan(model, x, y, F.cross_entropy, opt, plan).measured_peak_bytes
        # a launch is counted with the temporaries of the op that made its last gradient,
        # which the hook, running after that op, no longer sees: never below executed
        assert executed <= plan.predicted_peak_bytes <= budget
        assert plan.predicted_peak_bytes <= 1.05 * executed


def test_bucket_timeline_by_hand() -> None:
    # (birth, ready, bytes): "c" is made at event 1 (a gradient computed in the forward) and
    # accumulated at 5
    gradients = ((2, 2, 10), (3, 3, 20), (1, 5, 40), (6, 6, 8))
    names = ("a", "b", "c", "d")
    buckets = assign_buckets(gradients, names, cap_bytes=30)
    assert buckets == (("a", "b"), ("c",), ("d",))
    row = bucket_timeline(gradients, names, buckets, num_events=9, backward_end=7)
    # c alone: 1..6, a: 2..3, b: 3..3, flat(a,b)=30: 3..5, d alone: 6..7
    assert row.tolist() == [0, 40, 50, 100, 70, 70, 48, 8, 0]


def test_ddp_wrapped_before_the_plan_is_refused() -> None:
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("no torch.distributed")
    model = _net()
    with apply_plan(model, _plan(model), optimizer_factory=OPTIMIZERS["sgd"]) as handle:
        fake_ddp = nn.Module()
        fake_ddp.module = model  # type: ignore[assignment]
        fake_ddp.parameters_to_ignore = set()  # type: ignore[assignment]
        with pytest.raises(ConfigError, match="before the plan was applied"):
            handle.attach(fake_ddp)  # type: ignore[arg-type]


# --- DDP on 2 gloo ranks -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks() -> Ranks:
    return shared_ranks(2)


# what the accumulating runs do: 2 micro-batches per step (the first under no_sync), clipped
ACCUMULATE = TrainingStep(max_grad_norm=0.05, accumulation_steps=2)


def _micro_batches(ddp: DistributedDataParallel, rank: int, step: int, accumulate: bool) -> None:
    """One step's backward passes: one, or ``ACCUMULATE``'s with the first under no_sync."""
    if not accumulate:
        x, y = _batch(rank, step)
        F.cross_entropy(ddp(x), y).backward()
        return
    k = ACCUMULATE.accumulation_steps
    for m in range(k):
        x, y = _batch(rank, 10 * step + m)
        with ddp.no_sync() if m < k - 1 else contextlib.nullcontext():
            (F.cross_entropy(ddp(x), y) / k).backward()


def _plain_ddp(
    rank: int, world: int, steps: int, compression: str | None, accumulate: bool = False
) -> dict:
    model = DistributedDataParallel(_net(), bucket_cap_mb=0.001)
    if compression is not None:
        from superneurons.compress import register_compression

        register_compression(model, compression)
    opt = OPTIMIZERS["adamw"](list(model.parameters()))
    for step in range(steps):
        opt.zero_grad()
        _micro_batches(model, rank, step, accumulate)
        if accumulate:
            torch.nn.utils.clip_grad_norm_(model.parameters(), ACCUMULATE.max_grad_norm)
        opt.step()
    return {f: p.detach().clone() for f, p in model.module.named_parameters()}


def _host_ddp(
    rank: int,
    world: int,
    steps: int,
    compression: str | None,
    resume_at: int = -1,
    accumulate: bool = False,
) -> dict:
    model = _net()
    factory = OPTIMIZERS["adamw"]
    plan = _plan(model, _small_buckets(model))
    if accumulate:
        plan = replace(plan, step=ACCUMULATE)
    handle = apply_plan(model, plan, optimizer_factory=factory)
    ddp = DistributedDataParallel(model)
    handle.attach(ddp)
    if compression is not None:
        from superneurons.compress import register_compression

        register_compression(ddp, compression)  # captured: runs on the plan's buckets
    assert handle.optimizer is not None
    saved = None
    for step in range(steps):
        if step == resume_at:  # save, rebuild everything, load, go on
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "plan": handle.state_dict()}, buffer)
            handle.remove()
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=False)
            model = _net()
            model.load_state_dict(saved["model"])
            handle = apply_plan(model, plan, optimizer_factory=factory)
            ddp = DistributedDataParallel(model)
            handle.attach(ddp)
            handle.load_state_dict(saved["plan"])
        handle.optimizer.zero_grad()
        _micro_batches(ddp, rank, step, accumulate)
        if accumulate:
            handle.optimizer.clip_grad_norm_(ACCUMULATE.max_grad_norm)
        handle.optimizer.step()
        assert all(p.grad is None for p in model.parameters())  # nothing left on the device
    out = {f: p.detach().clone() for f, p in model.named_parameters()}
    handle.remove()
    return out


@pytest.mark.dist
@pytest.mark.parametrize(
    ("compression", "accumulate"),
    [(None, False), ("fp16", False), (None, True)],
    ids=["allreduce", "fp16-hook", "no_sync-accumulation-clipped"],
)
def test_ddp_host_optimizer_equals_plain_ddp_bitwise(
    ranks: Ranks, compression: str | None, accumulate: bool
) -> None:
    plain = ranks.run(_plain_ddp, 5, compression, accumulate)
    ours = ranks.run(_host_ddp, 5, compression, -1, accumulate)
    for rank in range(2):
        for fqn, value in plain[rank].items():
            assert torch.equal(value, ours[rank][fqn]), (rank, fqn)
    for fqn in plain[0]:  # and the ranks agree
        assert torch.equal(ours[0][fqn], ours[1][fqn])


@pytest.mark.dist
def test_ddp_host_optimizer_resumes_bitwise(ranks: Ranks) -> None:
    straight = ranks.run(_host_ddp, 5, None)
    resumed = ranks.run(_host_ddp, 5, None, 3)
    for rank in range(2):
        for fqn, value in straight[rank].items():
            assert torch.equal(value, resumed[rank][fqn]), (rank, fqn)


@pytest.mark.cuda
def test_cuda_masters_are_pinned_and_steps_match_the_device_optimizer() -> None:
    device = torch.device("cuda")
    eager, ours = _net().to(device), _net().to(device)
    factory = OPTIMIZERS["adamw"]
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.1)
    plan = _plan(ours, _small_buckets(ours))
    with apply_plan(ours, plan, optimizer_factory=factory) as handle:
        assert handle.buckets is not None
        masters = handle.buckets.optimizer.masters
        assert all(m.is_pinned() and m.device.type == "cpu" for m in masters.values())
        for step in range(3):
            x, y = (t.to(device) for t in _batch(0, step))
            opt.zero_grad()
            F.cross_entropy(eager(x), y).backward()
            opt.step()
            F.cross_entropy(ours(x), y).backward()
            assert all(p.grad is None for p in ours.parameters())
    for a, b in zip(eager.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)  # host vs device kernels
