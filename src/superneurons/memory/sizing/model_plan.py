"""``superneurons plan`` as one call: a target in, every strategy's floor and the plan out.

:func:`plan_model` profiles the target's step on fake tensors (a causal LM also below its
largest layer), searches each strategy's floor once, and plans for the budget from those same
searches; :meth:`ModelPlan.to_dict` is ``plan --json``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from superneurons.memory.plan import InfeasibleBudgetError, Plan, StrategyFloor, mlp_pieces
from superneurons.memory.planner.cost import CostModel
from superneurons.memory.planner.decide import (
    Floors,
    describe_floors,
    make_plan,
    search_floors,
    step_costs,
)
from superneurons.memory.profile_types import Profile
from superneurons.memory.sizing.llm import attention_ops, profile_causal_lm_below
from superneurons.memory.sizing.simulate import profile_zoo
from superneurons.memory.sizing.target import LMTarget, Target, ZooTarget, training_step

__all__ = ["ModelPlan", "parameter_fields", "pinned_host_bytes", "plan_model"]

PLAN_ACTIONS: tuple[str, ...] = ("keep", "offload", "recompute", "recompute+offload")


@dataclass(frozen=True)
class ModelPlan:
    """What ``plan`` found for a target: every strategy's floor, and the plan for the budget.

    Attributes:
        target: what was profiled.
        granularity: the units it was planned in (``auto`` resolved).
        device_preset: the cost model's device.
        eager_peak_bytes: the step's predicted peak with nothing planned.
        attention_ops: the attention kernels a causal LM's step ran (None: a zoo model).
        floors: strategy -> its smallest predicted peak and what it holds.
        strategy: the strategy asked for (``auto``: the planner's choice).
        budget_bytes: the device budget.
        plan: the plan, or None where no plan of ``strategy`` fits (then ``infeasible``).
        infeasible: why no plan fits, naming the minimum budget.
        parameters: what trains and what is frozen (:func:`parameter_fields`), for a causal
            LM that trains adapters; empty otherwise (the record is as it was).
        step_costs: what the target's training step (clipping) costs each strategy's floor
            (:func:`~superneurons.memory.planner.decide.step_costs`); {}: the plain step.
    """

    target: Target
    granularity: str
    device_preset: str
    eager_peak_bytes: int
    attention_ops: list[str] | None
    floors: dict[str, StrategyFloor]
    strategy: str
    budget_bytes: int
    plan: Plan | None
    infeasible: InfeasibleBudgetError | None = None
    parameters: dict[str, int] = field(default_factory=dict)
    step_compute_s: float = 0.0  # forward + backward (3x the units' forward), cost model
    step_costs: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def floor_strategy(self) -> str:
        """The strategy asked for, else the one with the lowest floor."""
        if self.strategy in self.floors:
            return self.strategy
        return min(self.floors, key=lambda s: self.floors[s].min_budget_bytes)

    def to_dict(self) -> dict[str, Any]:
        """``plan --json``: the target, the floors (docs/CONTRACTS.md) and the plan."""
        record = self.target.record()
        if isinstance(self.target, LMTarget):
            record.update(self.parameters)
            record.update(attention_ops=self.attention_ops, below=self.target.below)
        record.update(granularity=self.granularity, device_preset=self.device_preset)
        record.update(self._floor_fields())
        if self.step_costs:  # what clipping costs (the floors above include it)
            record["step_costs"] = self.step_costs
        if self.plan is None:
            assert self.infeasible is not None
            record.update(
                feasible=False,
                strategy=self.strategy,
                budget_bytes=self.budget_bytes,
                min_budget_bytes=self.infeasible.min_budget_bytes,
                min_budget_strategy=self.infeasible.strategy,
                message=str(self.infeasible),
            )
            return record
        record.update(self._plan_fields(self.plan))
        record["plan"] = self.plan.to_dict()
        return record

    def _floor_fields(self) -> dict[str, Any]:
        # the largest-layer bound (SuperNeurons' claim) of the strategy that reaches the floor,
        # with its own resident bytes (optimizer state on the host is not resident) and its
        # own profile's largest unit (below the largest layer: the chunked one)
        floor = self.floors[self.floor_strategy]
        return {
            "eager_peak_bytes": self.eager_peak_bytes,
            "step_compute_s": self.step_compute_s,
            "floor_strategy": self.floor_strategy,
            "resident_bytes": floor.resident_bytes,
            "largest_unit_bytes": floor.largest_unit_bytes,
            "floor_bytes": floor.min_budget_bytes,
            "floor_over_largest_layer": floor.floor_over_largest_layer,
            "floor_over_eager": floor.min_budget_bytes / self.eager_peak_bytes,
            "strategies": {name: f.to_dict() for name, f in self.floors.items()},
        }

    def _plan_fields(self, plan: Plan) -> dict[str, Any]:
        return {
            "feasible": plan.feasible,
            "strategy": plan.strategy,
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "min_budget_bytes": plan.min_budget_bytes,
            "host_bytes": plan.host_bytes,
            "extra_compute_s": plan.extra_compute_s,
            "transfer_s": plan.transfer_s,
            "optimizer_in_backward": plan.optimizer_in_backward,
            "optimizer_on_host": plan.optimizer_on_host,
            "optimizer_host_bytes": plan.optimizer_host_bytes,
            "optimizer_copy_s": plan.optimizer_copy_s,
            "peak_at": plan.peak_at,
            "breakdown": plan.breakdown,
            "units": {a: plan.count(a) for a in PLAN_ACTIONS},
            "segments": len({u.segment for u in plan.units if u.segment >= 0}),
            "head_chunk_tokens": plan.head.chunk_tokens if plan.head else None,
            "head_mode": plan.head.mode if plan.head else None,
            "mlp_pieces": mlp_pieces(plan.seq_chunks),
            # the host link: weights streamed, copies no compute hides, pinned host memory
            "units_streamed": len(plan.streamed_units()),
            "streamed_bytes_per_step": plan.streamed_bytes,
            "exposed_transfer_s": plan.exposed_transfer_s,
            "weights_host_bytes": plan.weights_host_bytes,
            "pinned_host_bytes": pinned_host_bytes(plan),
        }


def plan_model(
    target: Target,
    *,
    budget_bytes: int,
    strategy: str = "auto",
    cost: CostModel,
    progress: Callable[[str], None] | None = None,
) -> ModelPlan:
    """Profile ``target``'s step on fake tensors, search every strategy's floor once and plan
    for ``budget_bytes`` from those searches. ``progress``: called with a line as each phase
    ends (a language model's profiles and searches take minutes at 70B).

    A budget below every plan of ``strategy`` is no error here: the result carries the
    :class:`~superneurons.memory.plan.InfeasibleBudgetError` (``infeasible``) beside the floors.

    Raises:
        ConfigError: the target cannot be profiled, or ``strategy`` cannot run on it.
    """
    ops, parameters = None, {}
    step = training_step(target)
    report = progress or (lambda _: None)
    if isinstance(target, LMTarget):
        plain, chunked = profile_causal_lm_below(
            target.config,
            target.step,
            variants=target.variants,
            check_positions=not target.beyond_positions,
            progress=progress,
        )
        profile, granularity = plain, "block"
        start_s = time.perf_counter()
        floors = search_floors(plain, cost=cost, chunked=chunked, step=step)
        report(f"searched every strategy's floor in {time.perf_counter() - start_s:.1f} s")
        ops = attention_ops(plain)
        parameters = parameter_fields(plain) if target.lora is not None else {}
    else:
        profile, granularity, floors = _zoo_profile(target, strategy, cost)
    described = describe_floors(floors)
    plan, infeasible = None, None
    try:
        plan = make_plan(profile, budget_bytes=budget_bytes, strategy=strategy, floors=floors)
    except InfeasibleBudgetError as exc:
        infeasible = exc
    return ModelPlan(
        target=target,
        granularity=granularity,
        device_preset=cost.name,
        eager_peak_bytes=profile.predicted_peak_bytes(),
        attention_ops=ops,
        floors=described,
        strategy=strategy,
        budget_bytes=budget_bytes,
        plan=plan,
        infeasible=infeasible,
        parameters=parameters,
        # NOTE: backward ~ 2x forward (two GEMMs per forward GEMM): the step ~ 3x the forward
        step_compute_s=3 * sum(cost.unit_seconds(profile).values()),
        step_costs=_step_costs(floors),
    )


def pinned_host_bytes(plan: Plan) -> int:
    """The pinned host memory ``plan`` needs: offloaded activations, the optimizer's state and
    fp32 masters off the device, and the streamed weights' host copies."""
    return plan.host_bytes + plan.optimizer_host_bytes + plan.weights_host_bytes


def parameter_fields(profile: Profile) -> dict[str, int]:
    """``plan --json``'s parameter fields of a step that trains adapters: ``trainable_params``
    (elements stepped), ``trainable_bytes`` (their gradients' bytes, the parameters' dtype),
    ``frozen_bytes`` (parameters without a gradient: the frozen or quantized base and its
    quantization state), all from the profile."""
    return {
        "trainable_params": profile.param_numel,
        "trainable_bytes": profile.grad_bytes,
        "frozen_bytes": profile.frozen_bytes,
    }


def _step_costs(floors: Floors) -> dict[str, dict[str, float]]:
    """What the target's training step costs each strategy: its floors against those of the
    same profiles searched again for the plain step ({} for the plain step itself)."""
    if floors.step is None:
        return {}
    plain, *chunked = floors.profiles
    return step_costs(floors, search_floors(plain, cost=floors.cost, chunked=chunked))


def _zoo_profile(target: ZooTarget, strategy: str, cost: CostModel) -> tuple[Profile, str, Floors]:
    """The zoo profile at the target's granularity; ``auto``: blocks or the largest blocks
    split, whichever gives ``strategy`` (``auto``: any strategy) the lower floor (blocks suit
    checkpointing, split blocks suit the tensor pool)."""
    options = dict(
        batch_size=target.batch_size, optimizer=target.optimizer, **target.model_kwargs()
    )
    tried = []
    for granularity in (
        ("block", "split") if target.granularity == "auto" else (target.granularity,)
    ):
        profile = profile_zoo(target.name, granularity=granularity, **options)
        floors = search_floors(profile, cost=cost, step=training_step(target))
        minima = floors.peak_bytes()
        floor = minima[strategy] if strategy in minima else min(minima.values())
        tried.append((floor, granularity, profile, floors))
    _, granularity, profile, floors = min(tried, key=lambda t: t[0])
    return profile, granularity, floors
