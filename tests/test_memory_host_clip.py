"""The optimizer off the device under clipping and gradient accumulation (``Plan.step``): the
host optimizer and optimizer-in-backward equal ``torch.nn.utils.clip_grad_norm_`` followed by
the same optimizer on the device, bit for bit (several norms; infinite and NaN gradients step
as Trainer steps them), and k micro-batches accumulate as eager ``.grad`` does, alone and
under DDP's ``no_sync`` on 2 gloo ranks."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory import Plan, UnitDecision, apply_plan
from superneurons.memory.plan import TrainingStep

Factory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """Two groups (no decay on biases and 1-d tensors), fused: the host optimizer's kernel."""
    params = list(params)
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
        ],
        lr=1e-2,
        fused=True,
    )


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(12, 32)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2)
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
    return torch.randn(8, 12, generator=gen), torch.randint(0, 7, (8,), generator=gen)


def _small_buckets(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    names = [fqn for fqn, _ in model.named_parameters()][::-1]
    return tuple(tuple(names[i : i + 3]) for i in range(0, len(names), 3))


def _plan(model: nn.Module, step: TrainingStep, *, host: bool = True) -> Plan:
    units = (UnitDecision("blocks.0", "recompute"), UnitDecision("blocks.1", "keep"))
    if not host:
        return Plan(
            units=units,
            strategy="offload+opt-in-backward",
            budget_bytes=1 << 30,
            optimizer_in_backward=True,
            step=step,
        )
    return Plan(
        units=units,
        strategy="offload+host-optimizer",
        budget_bytes=1 << 30,
        host_optimizer=True,
        grad_buckets=_small_buckets(model),
        step=step,
    )


def _poison(model: nn.Module, value: float) -> Any:
    """A hook making one element of the first block's weight gradient ``value``."""
    param = model.blocks[0][0].weight

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[3] = value
        return grad

    return param.register_hook(hook)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN where NaN."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32)) or (
        torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    )


def _eager(steps: int, step: TrainingStep, poison: float | None = None) -> tuple[Any, list[Any]]:
    """The reference: k micro-batches (loss / k) into ``.grad``, clip_grad_norm_, step."""
    model = _net()
    opt = adamw(list(model.parameters()))
    if poison is not None:
        _poison(model, poison)
    k, norms = step.accumulation_steps, []
    for s in range(steps):
        opt.zero_grad()
        for m in range(k):
            x, y = _batch(0, s * k + m)
            (F.cross_entropy(model(x), y) / k).backward()
        if step.clips:
            norms.append(
                torch.nn.utils.clip_grad_norm_(
                    model.parameters(), step.max_grad_norm, step.norm_type
                )
            )
        opt.step()
    return model, norms


def _host(
    steps: int, step: TrainingStep, *, sync: bool = True, poison: float | None = None
) -> tuple[Any, list[Any]]:
    """The same loop with the plan's host optimizer as the loop's optimizer."""
    model = _net()
    k, norms = step.accumulation_steps, []
    with apply_plan(model, _plan(model, step), optimizer_factory=adamw) as handle:
        opt, buckets = handle.optimizer, handle.buckets
        assert opt is not None and buckets is not None
        micro = [0]
        if sync:  # the loop says which backward is the last of its micro-batches
            buckets.sync = lambda: micro[0] == k - 1
        if poison is not None:
            _poison(model, poison)
        for s in range(steps):
            opt.zero_grad()
            for m in range(k):
                micro[0] = m
                x, y = _batch(0, s * k + m)
                (F.cross_entropy(model(x), y) / k).backward()
                assert all(p.grad is None for p in model.parameters())
            if step.clips:
                norms.append(
                    opt.clip_grad_norm_(step.max_grad_norm, step.norm_type, model.parameters())
                )
            opt.step()
    return model, norms


@pytest.mark.parametrize(
    ("max_norm", "norm_type"), [(0.05, 2.0), (1.0, math.inf), (1e4, 2.0), (0.3, 1.0)]
)
def test_host_clipping_equals_clip_grad_norm_then_the_step(
    max_norm: float, norm_type: float
) -> None:
    step = TrainingStep(max_grad_norm=max_norm, norm_type=norm_type)
    eager, eager_norms = _eager(3, step)
    ours, our_norms = _host(3, step)
    assert [float(n) for n in eager_norms] == [float(n) for n in our_norms]
    for (fqn, a), b in zip(eager.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(a, b), fqn


@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
def test_non_finite_gradients_step_as_trainer_does(value: float) -> None:
    # Trainer calls clip_grad_norm_ with error_if_nonfinite=False and steps whatever it
    # returns: the total norm is inf or NaN, every gradient is scaled by 0 or NaN, the step
    # runs and the parameters it reaches turn NaN; nothing is skipped
    step = TrainingStep(max_grad_norm=1.0)
    eager, eager_norms = _eager(2, step, poison=value)
    ours, our_norms = _host(2, step, poison=value)
    assert not math.isfinite(float(eager_norms[0]))
    assert _same(torch.stack(eager_norms), torch.stack(our_norms))
    assert any(p.isnan().any() for p in eager.parameters())
    for (fqn, a), b in zip(eager.named_parameters(), ours.parameters(), strict=True):
        assert _same(a.detach(), b.detach()), fqn


@pytest.mark.parametrize("k", [1, 2, 4])
def test_accumulation_equals_eager_accumulation(k: int) -> None:
    step = TrainingStep(accumulation_steps=k, max_grad_norm=0.5 if k == 2 else 0.0)
    eager, eager_norms = _eager(2, step)
    ours, our_norms = _host(2, step, sync=k != 4)  # k=4: every backward taken as the last
    assert [float(n) for n in eager_norms] == [float(n) for n in our_norms]
    for (fqn, a), b in zip(eager.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(a, b), fqn


def test_the_plain_plan_reports_the_norm_and_refuses_to_clip_or_accumulate() -> None:
    model = _net()
    with apply_plan(model, _plan(model, TrainingStep()), optimizer_factory=adamw) as handle:
        opt, buckets = handle.optimizer, handle.buckets
        assert opt is not None and buckets is not None
        reference = _net()
        x, y = _batch(0, 0)
        F.cross_entropy(reference(x), y).backward()
        F.cross_entropy(model(x), y).backward()  # stepped in backward
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), math.inf)
        assert torch.equal(opt.clip_grad_norm_(math.inf), norm)  # what Trainer logs
        with pytest.raises(ConfigError, match="max_grad_norm"):
            opt.clip_grad_norm_(1.0)
        buckets.sync = lambda: False
        with pytest.raises(ConfigError, match="accumulation_steps"):
            F.cross_entropy(model(x), y).backward()


def test_training_step_is_validated_and_round_trips() -> None:
    for bad in ({"max_grad_norm": -1.0}, {"accumulation_steps": 0}, {"norm_type": 0.0}):
        with pytest.raises(ConfigError):
            TrainingStep(**bad)
    model = _net()
    plan = _plan(model, TrainingStep(max_grad_norm=1.0, accumulation_steps=2))
    assert Plan.from_json(plan.to_json()) == plan
    assert (
        "step"
        not in _plan(model, TrainingStep())
        .__class__(units=(), strategy="eager", budget_bytes=1)
        .to_dict()
    )


def _in_backward(steps: int, step: TrainingStep, *, on_host: bool) -> tuple[Any, list[Any]]:
    """The loop under an optimizer-in-backward plan (state in the host pool with
    ``on_host``): backward only; the plan clips and steps when the last micro-batch ends."""
    model = _net()
    plan = _plan(model, step, host=False)
    if on_host:
        plan = Plan(
            **{**plan.__dict__, "strategy": "offload+opt-on-host", "optimizer_on_host": True}
        )
    k, norms = step.accumulation_steps, []

    def one(params: list[torch.Tensor]) -> torch.optim.Optimizer:  # per parameter, as adamw
        wd = 0.1 if params[0].dim() > 1 else 0.0
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=wd, fused=True)

    with apply_plan(model, plan, optimizer_factory=one) as handle:
        waiting = handle.waiting_steps
        assert waiting is not None
        for s in range(steps):
            for m in range(k):
                x, y = _batch(0, s * k + m)
                (F.cross_entropy(model(x), y) / k).backward()
                stepped = m == k - 1
                assert all((p.grad is None) == stepped for p in model.parameters())
            if step.clips:
                norms.append(waiting.grad_norm)
    return model, norms


@pytest.mark.parametrize(
    ("k", "max_norm", "on_host"), [(1, 0.05, False), (2, 0.5, True), (4, 0.0, False)]
)
def test_optimizer_in_backward_clips_and_accumulates_as_eager(
    k: int, max_norm: float, on_host: bool
) -> None:
    step = TrainingStep(max_grad_norm=max_norm, accumulation_steps=k)
    eager, eager_norms = _eager(2, step)
    ours, our_norms = _in_backward(2, step, on_host=on_host)
    assert [float(n) for n in eager_norms] == [float(n) for n in our_norms]
    for (fqn, a), b in zip(eager.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(a, b), fqn


# --- the planner ---------------------------------------------------------------------------------
def _measured_peaks(strategy: str, k: int) -> tuple[int, int, Plan]:
    """(predicted peak, measured peak of the last micro-batch and its step, plan) of a real
    CPU run of ``strategy`` accumulating ``k`` micro-batches, in the second step."""
    from superneurons.memory import LiveStorageTracker, make_plan, profile_step

    model = _net()
    opt = adamw(list(model.parameters()))
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(64, 12, generator=gen), torch.randint(0, 7, (64,), generator=gen)
    profile = profile_step(model, x, y, F.cross_entropy, opt)
    plan = make_plan(
        profile,
        budget_bytes=1 << 30,
        strategy=strategy,
        step=TrainingStep(accumulation_steps=k) if k > 1 else None,
    )
    host = plan.host_optimizer
    with apply_plan(model, plan, optimizer_factory=adamw if host else None) as handle:
        loop: Any = handle.optimizer if host else opt
        for _ in range(2):
            loop.zero_grad()
            for m in range(k):
                tracker = LiveStorageTracker()
                state = [] if host else [t for s in opt.state.values() for t in s.values()]
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                tracker.register([*model.parameters(), *grads, *state])
                with tracker:
                    (F.cross_entropy(model(x), y) / k).backward()
                    if m == k - 1:
                        loop.step()
    return plan.predicted_peak_bytes, tracker.peak_bytes, plan


def test_the_planner_counts_the_accumulation_buffers() -> None:
    # on the device: every gradient resident through the later micro-batches, the new one a
    # transient until autograd adds it: the prediction grows by what the run grows by
    one, one_run, _ = _measured_peaks("recompute", 1)
    two, two_run, plan = _measured_peaks("recompute", 2)
    assert two - one == two_run - one_run > 0
    assert two_run <= two and plan.step == TrainingStep(accumulation_steps=2)
    # on the host: the sums live in host buffers (host bytes), the device only sees each
    # bucket's sum for the moment it is added
    plain_host, _, plain = _measured_peaks("offload+host-optimizer", 1)
    host, host_run, acc = _measured_peaks("offload+host-optimizer", 2)
    grads = sum(p.numel() * p.element_size() for p in _net().parameters())
    assert acc.optimizer_host_bytes == plain.optimizer_host_bytes + grads
    assert host_run <= host and host - plain_host <= grads // 2


def test_clipping_costs_the_host_optimizer_time_not_device_bytes() -> None:
    from superneurons.memory import make_plan, profile_step

    model = _net()
    x, y = _batch(0, 0)
    profile = profile_step(model, x, y, F.cross_entropy, adamw(list(model.parameters())), fake=True)
    host = "offload+host-optimizer"
    plain = make_plan(profile, budget_bytes=1 << 30, strategy=host)
    clipped = make_plan(
        profile, budget_bytes=1 << 30, strategy=host, step=TrainingStep(max_grad_norm=1.0)
    )
    assert clipped.predicted_peak_bytes == plain.predicted_peak_bytes
    assert clipped.transfer_s == plain.transfer_s
    # the host step no longer hides behind backward: all of it is exposed
    from superneurons.memory.planner.decide import describe_floors, search_floors

    before = describe_floors(search_floors(profile))[host]
    after = describe_floors(search_floors(profile, step=TrainingStep(max_grad_norm=1.0)))[host]
    assert after.min_budget_bytes == before.min_budget_bytes
    assert after.predicted_overhead_s > before.predicted_overhead_s
    # optimizer-in-backward keeps every gradient to the end of backward
    inb = "offload+opt-in-backward"
    free = make_plan(profile, budget_bytes=1 << 30, strategy=inb)
    kept = make_plan(
        profile, budget_bytes=1 << 30, strategy=inb, step=TrainingStep(max_grad_norm=1.0)
    )
    assert kept.predicted_peak_bytes > free.predicted_peak_bytes


def test_the_loops_optimizer_schedule_and_groups_drive_the_waiting_host_step() -> None:
    """A loop's own AdamW (two weight-decay groups) and LR schedule, handed over to the host
    optimizer, with clipping and 2 micro-batches: the schedule's LR reaches each host step and
    the result is the loop's own, bitwise."""
    from superneurons.memory.offload.handover import factory_like, hand_over

    step = TrainingStep(max_grad_norm=0.05, accumulation_steps=2)
    runs = []
    for host in (False, True):
        model = _net()
        opt = adamw(list(model.parameters()))
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        handle = None
        if host:
            handle = apply_plan(
                model, _plan(model, step), optimizer_factory=factory_like(opt, model)
            )
            handover = hand_over(opt, handle)
        for s in range(3):
            opt.zero_grad()
            for m in range(2):
                x, y = _batch(0, 2 * s + m)
                (F.cross_entropy(model(x), y) / 2).backward()
            params = list(model.parameters())
            if handle is not None:
                assert handle.optimizer is not None
                handle.optimizer.clip_grad_norm_(step.max_grad_norm, parameters=params)
            else:
                torch.nn.utils.clip_grad_norm_(params, step.max_grad_norm)
            opt.step()  # the host's step runs in its post-hook
            schedule.step()
        if handle is not None:
            # the host took the LR the schedule set for its last step (1 / (1 + 2)), taken
            # before each step: the loop's has moved on since
            lrs = [g["lr"] for g in handle.optimizer.param_groups]  # type: ignore[union-attr]
            assert (
                lrs == [1e-2 * (1 / 3)] * 2
                and [g["lr"] for g in opt.param_groups] == [1e-2 / 4] * 2
            )
            assert not opt.state  # the loop's optimizer holds none
            handover.remove()
            handle.remove()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_cuda_clipping_and_accumulation_match_the_device_within_rounding() -> None:
    device = torch.device("cuda")
    step = TrainingStep(max_grad_norm=0.05, accumulation_steps=2)
    eager, ours = _net().to(device), _net().to(device)
    opt = adamw(list(eager.parameters()))
    with apply_plan(ours, _plan(ours, step), optimizer_factory=adamw) as handle:
        host = handle.optimizer
        assert host is not None
        for s in range(3):
            opt.zero_grad()
            for m in range(2):
                x, y = (t.to(device) for t in _batch(0, 2 * s + m))
                (F.cross_entropy(eager(x), y) / 2).backward()
                (F.cross_entropy(ours(x), y) / 2).backward()
            norm = torch.nn.utils.clip_grad_norm_(eager.parameters(), step.max_grad_norm)
            ours_norm = host.clip_grad_norm_(step.max_grad_norm)
            torch.testing.assert_close(ours_norm.to(device), norm, rtol=1e-5, atol=0)
            opt.step()
            host.step()
    for a, b in zip(eager.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)  # host vs device kernels
