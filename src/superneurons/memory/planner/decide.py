"""The cost-aware planner: Profile + byte budget -> Plan (pure; no tensors are touched).

Rules (SuperNeurons, Wang et al., PPoPP'18 §3.2-3.3), then a greedy improvement:

* **offload** the saved activations of compute-heavy units (conv, matmul): their forward hides the
  copy to the host and the backward of the unit after them hides the prefetch (the runtime
  prefetches one unit ahead), so the exposed cost is ``max(0, copy_s - compute_s)``;
* **recompute** cheap units (BN, activations, pooling): cost is their forward time, from FLOPs and
  bytes written under a roofline (or measured, for real profiles);
* when the budget demands more, **recompute+offload**: the unit is recomputed *and* its checkpoint
  (the input the checkpoint saves) goes to the host pool, prefetched one unit ahead in backward,
  so nothing of the unit stays on the device between its forward and its backward; this is what
  brings the peak down to the largest unit's working set (``memory.planner.bounds``);
* candidates are taken in ascending *cost per byte saved* (the DTR heuristic of Kirisame et al.,
  ICLR'21, applied offline) until the predicted peak fits the budget. The chosen plan is the
  shortest prefix that fits, so the predicted peak never rises when the budget falls.

The peak under a plan is predicted from the profile's measured live intervals: a storage saved only
by non-keep units is absent between the end of its units' forward and their backward (recompute)
or the prefetch one unit ahead (offload, recompute+offload); plain checkpoint inputs stay; recompute
adds its transient forward bytes at the unit's backward start. ``optimizer_in_backward`` frees each
gradient as soon as it is applied (``register_post_accumulate_grad_hook``), so the gradient row of
the timeline and the step phase drop to the largest single gradient. Strategy
``offload+opt-on-host`` may also keep the optimizer state in the host pool (ZeRO-Offload's
placement, Ren et al. ATC'21): on the device only the state of the parameter being stepped and the
one prefetched (:func:`~superneurons.memory.planner.predict_steps.host_state_timeline`), its copies
timed by the device preset beside backward. Strategy ``offload+host-optimizer`` runs the optimizer
itself on the host (state, fp32 masters and the step; ZeRO-Offload's placement), each bucket of
gradients leaving the device once launched (:mod:`superneurons.memory.planner.buckets`); unlike
optimizer-in-backward it steps after each bucket's all-reduce, so DDP can use it.

Below the largest layer: ``make_plan(..., chunked=...)`` takes profiles of the same step with the
LM head + loss in chunks and block sub-layers split over the sequence
(:mod:`superneurons.memory.profiling.below`); each strategy uses the plain profile when it fits the
budget and the first chunked one that does otherwise, so chunks (and their recompute) are used only
when the budget needs them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from superneurons.bytesize import format_bytes
from superneurons.errors import ConfigError
from superneurons.memory.plan import (
    PLAN_VERSION,
    SEARCH_STRATEGIES,
    SINGLE_DEVICE_STRATEGIES,
    STRATEGIES,
    InfeasibleBudgetError,
    Plan,
    StrategyFloor,
    TensorDecision,
    TrainingStep,
    UnitDecision,
    mlp_pieces,
)
from superneurons.memory.planner.bounds import head_loss_bytes, largest_unit_bytes, resident_bytes
from superneurons.memory.planner.cost import CostModel
from superneurons.memory.planner.predict import evaluate
from superneurons.memory.planner.strategy_search import (
    HOST_OPTIMIZER,
    IN_BACKWARD,
    STREAM_WEIGHTS,
    Choice,
    search_all,
    usable,
)
from superneurons.memory.profile_types import Profile

__all__ = [
    "CostModel",
    "Floors",
    "describe_floors",
    "evaluate",
    "make_plan",
    "min_peak_bytes",
    "search_floors",
    "step_costs",
    "strategy_floors",
]

logger = logging.getLogger("superneurons.memory")


def make_plan(
    profile: Profile,
    *,
    budget_bytes: int,
    strategy: str = "auto",
    bandwidth_bytes_per_s: float = 25e9,
    optimizer_in_backward: bool = False,
    allow_optimizer_in_backward: bool = True,
    allow_host_optimizer: bool = True,
    cost: CostModel | None = None,
    chunked: Sequence[Profile] = (),
    floors: Floors | None = None,
    allow_weight_streaming: bool = True,
    step: TrainingStep | None = None,
) -> Plan:
    """Plan keep / offload / recompute per unit so the predicted peak fits ``budget_bytes``.

    ``allow_optimizer_in_backward=False`` keeps ``auto`` (and the minimum an infeasible budget
    names) to strategies that step the optimizer after backward, as DDP needs (a parameter
    would be stepped before its gradient is all-reduced); ``allow_host_optimizer=False`` away
    from ``offload+host-optimizer`` (a model DDP already wraps: the plan goes on before it).

    ``strategy``: ``eager`` (keep all), ``checkpoint`` (recompute every unit), ``recompute``
    (cost-aware recompute only), ``offload`` (cost-aware offload and recompute),
    ``offload+opt-in-backward`` (also step the optimizer in backward), ``offload+opt-on-host``
    (that, with the optimizer state in the host pool when the budget needs it:
    ``Plan.optimizer_on_host``), ``auto`` (the feasible plan with the least exposed time,
    optimizer-in-backward only if nothing else fits, or if ``optimizer_in_backward=True``, and
    the state on the host only if nothing on the device fits), ``offload+host-optimizer``
    (the optimizer on the host, stepped per gradient bucket: DDP-compatible; ``auto`` takes it
    last, when nothing else fits).

    ``chunked``: profiles of the same step below the largest layer (the LM head + loss in
    chunks, sub-layers split over the sequence: ``memory.profiling.below``), tried in order by each
    strategy when the plain profile does not fit; the plan carries the chunking it used.
    ``floors``: :func:`search_floors` of the same
    profiles and cost, when the caller has searched them already (``plan`` reports them).
    ``stream-weights``: the host optimizer's plan, then units' weights in the host pool, copied
    to the device around their forward and backward (the cheapest copies first, only while the
    budget needs them: :mod:`superneurons.memory.planner.weights`); ``auto`` takes it after
    everything else. ``allow_weight_streaming=False`` rules it out (data parallelism: a
    streamed unit's weights are one device's; FSDP2 shards them across devices instead).

    Raises:
        InfeasibleBudgetError: no plan of ``strategy`` fits; the message names the minimum budget
            and the strategy that reaches it.
        ConfigError: bad strategy or budget.
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ConfigError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    if floors is None:
        cost = _cost_of(profile, cost, bandwidth_bytes_per_s)
        floors = search_floors(profile, cost=cost, chunked=chunked, step=step)
    elif step is not None and floors.step != _plain(step):
        raise ConfigError("floors= were searched for another training step than step=")
    step = floors.step
    allowed = _Allowed(
        optimizer_in_backward,
        allow_optimizer_in_backward,
        allow_host_optimizer,
        allow_weight_streaming,
    )
    minima = allowed.minima(floors, strategy)
    order = [strategy]
    if strategy == "auto":
        order = [s for s in allowed.auto_order() if s in floors.choices]  # runnable ones
        chosen = _least_exposed(floors, order, budget_bytes)
        minima["auto"] = min(minima[s] for s in order)
    else:
        chosen = search_all(floors.profiles, strategy, budget_bytes, floors.cost, step)
        if optimizer_in_backward and not chosen.optimizer_in_backward:
            chosen.optimizer_in_backward = True
            chosen.outcome = evaluate(
                chosen.profile or profile,
                chosen.actions,
                optimizer_in_backward=True,
                cost=floors.cost,
                segments=chosen.segments,
                step=step,
            )
    # NOTE: the minimum named (error and Plan) is the one this call reaches with the same
    # arguments: the floor of the strategy asked for (``auto``: of the strategies it may take),
    # never another strategy's the caller did not ask for; that one is named as advice only
    reachable = minima.get(strategy, chosen.outcome.peak_bytes)
    if chosen.outcome.peak_bytes > budget_bytes:
        raise InfeasibleBudgetError(
            f"budget {format_bytes(budget_bytes)} is below the smallest predicted peak of strategy "
            f"{strategy!r}: its minimum is {format_bytes(reachable)} = {reachable} bytes; raise the "
            f"budget to at least that, or shrink the batch"
            f"{_lower_elsewhere(minima, strategy, reachable)}",
            min_budget_bytes=reachable,
            strategy=next((s for s in order if minima.get(s) == reachable), strategy),
        )
    plan = _plan_of(chosen, chosen.profile or profile, budget_bytes, reachable)
    return plan if step is None else replace(plan, step=step)


def _lower_elsewhere(minima: dict[str, int], strategy: str, floor: int) -> str:
    """Advice: a strategy the caller may pass that reaches lower than ``floor``, or ""."""
    others = {s: v for s, v in minima.items() if s not in (strategy, "auto")}
    if not others or min(others.values()) >= floor:
        return ""
    best = min(others, key=lambda s: others[s])
    return f" (strategy={best!r} reaches {format_bytes(others[best])} where it can run)"


@dataclass(frozen=True)
class Floors:
    """Every strategy's search with no budget over one step's profiles (the plain one, then
    those below the largest layer), searched once: the floors ``plan`` reports and the minimum
    ``make_plan`` names, from the same searches (an 8B-parameter step: 250 evaluations of a
    28,000-event timeline per strategy).

    Attributes:
        profiles: the plain profile, then the chunked ones.
        cost: the device cost model the searches used.
        choices: strategy -> its least-peak search, for every search strategy the profiles can
            run (:data:`~superneurons.memory.plan.SEARCH_STRATEGIES`).
        step: the training step the searches were for (clipping, accumulation; None: plain).
    """

    profiles: tuple[Profile, ...]
    cost: CostModel
    choices: dict[str, Choice]
    step: TrainingStep | None = None  # the training step searched for (None: the plain one)

    def peak_bytes(self) -> dict[str, int]:
        """Strategy -> its smallest predicted peak."""
        return {s: c.outcome.peak_bytes for s, c in self.choices.items()}


def search_floors(
    profile: Profile,
    *,
    cost: CostModel | None = None,
    chunked: Sequence[Profile] = (),
    step: TrainingStep | None = None,
) -> Floors:
    """Each search strategy's least-peak plan over ``profile`` and the ``chunked`` profiles of
    the same step, for a loop that clips or accumulates as ``step`` says (None: neither)."""
    cost = cost or CostModel()
    profiles = (profile, *chunked)
    step = _plain(step)
    choices = {
        s: search_all(profiles, s, None, cost, step)
        for s in SEARCH_STRATEGIES
        if usable(profiles, s)
    }
    return Floors(profiles, cost, choices, step)


def step_costs(floors: Floors, plain: Floors) -> dict[str, dict[str, float]]:
    """What the training step ``floors`` were searched for (clipping, accumulation) costs each
    strategy: its floor there against its floor in ``plain`` (the same profiles searched for
    the plain step), as differences of the peak (``device_bytes``), of the host bytes
    (``host_bytes``: activations and the optimizer's host side) and of the predicted overhead
    per micro-batch (``overhead_s``)."""
    costs = {}
    for strategy in (s for s in floors.choices if s in plain.choices):
        stepped, base = floors.choices[strategy].outcome, plain.choices[strategy].outcome
        costs[strategy] = {
            "device_bytes": stepped.peak_bytes - base.peak_bytes,
            "host_bytes": (stepped.host_bytes + stepped.optimizer_host_bytes)
            - (base.host_bytes + base.optimizer_host_bytes),
            "overhead_s": (stepped.extra_compute_s + stepped.exposed_s)
            - (base.extra_compute_s + base.exposed_s),
        }
    return costs


def _plain(step: TrainingStep | None) -> TrainingStep | None:
    """None for the plain step (no clipping, no accumulation): plans made for it read as they
    always have."""
    return None if step is None or step == TrainingStep() else step


def min_peak_bytes(
    profile: Profile, *, cost: CostModel | None = None, chunked: Sequence[Profile] = ()
) -> dict[str, int]:
    """The smallest predicted peak each strategy reaches (strategy -> bytes), over ``profile``
    and the ``chunked`` profiles of the same step."""
    return search_floors(profile, cost=cost, chunked=chunked).peak_bytes()


def strategy_floors(
    profile: Profile,
    *,
    cost: CostModel | None = None,
    strategies: tuple[str, ...] = SEARCH_STRATEGIES,
    chunked: Sequence[Profile] = (),
) -> dict[str, StrategyFloor]:
    """Each strategy's smallest predicted peak, where it is and what it holds (``plan --json``
    ``strategies``): the plan each strategy reaches with no budget (over ``profile`` and the
    ``chunked`` profiles of the same step), evaluated once."""
    return describe_floors(search_floors(profile, cost=cost, chunked=chunked), strategies)


def describe_floors(
    floors: Floors, strategies: tuple[str, ...] = SEARCH_STRATEGIES
) -> dict[str, StrategyFloor]:
    """:func:`strategy_floors` of searches already made."""
    profile = floors.profiles[0]
    eager = profile.predicted_peak_bytes()
    described = {}
    sets: dict[int, tuple[int, int]] = {}  # id(profile) -> (largest unit, head + loss) bytes
    for strategy in (s for s in strategies if s in floors.choices):
        best = floors.choices[strategy]
        outcome, used = best.outcome, best.profile or profile
        if id(used) not in sets:
            sets[id(used)] = (largest_unit_bytes(used), head_loss_bytes(used))
        largest, head_loss = sets[id(used)]
        resident = used.param_bytes - outcome.weights.host_bytes
        if not best.host_optimizer:
            resident += 0 if best.optimizer_in_backward else used.grad_bytes
            resident += 0 if best.optimizer_on_host else used.optimizer_state_bytes
        described[strategy] = StrategyFloor(
            strategy=strategy,
            min_budget_bytes=outcome.peak_bytes,
            eager_peak_bytes=eager,
            resident_bytes=resident,
            largest_unit_bytes=largest,
            host_bytes=outcome.host_bytes,
            predicted_overhead_s=outcome.extra_compute_s + outcome.exposed_s,
            peak_at=outcome.peak_at,
            breakdown=outcome.breakdown,
            supports_ddp=strategy not in SINGLE_DEVICE_STRATEGIES,
            optimizer_on_host=best.optimizer_on_host,
            optimizer_host_bytes=outcome.optimizer_host_bytes,
            head_loss_working_set_bytes=head_loss,
            head_chunk_tokens=used.head.chunk_tokens if used.head else None,
            mlp_pieces=mlp_pieces(used.seq_chunks),
            streamed_bytes=outcome.weights.streamed_bytes,
            weights_host_bytes=outcome.weights.host_bytes,
            exposed_transfer_s=outcome.exposed_s,
            pinned_host_bytes=(
                outcome.host_bytes + outcome.optimizer_host_bytes + outcome.weights.host_bytes
            ),
        )
    return described


def _cost_of(profile: Profile, cost: CostModel | None, bandwidth_bytes_per_s: float) -> CostModel:
    """The cost model given, else the copy rates a real CUDA profile measured, else the
    default device's with ``bandwidth_bytes_per_s``."""
    if cost is not None:
        return cost
    if min(profile.copy_bytes_per_s) > 0:
        d2h, h2d = profile.copy_bytes_per_s  # measured with a real CUDA profile
        return replace(CostModel(), bandwidth_bytes_per_s=d2h, h2d_bytes_per_s=h2d, name="measured")
    return CostModel(bandwidth_bytes_per_s=bandwidth_bytes_per_s)


@dataclass(frozen=True)
class _Allowed:
    """Which strategies a caller allows: DDP rules out stepping in backward, a model DDP
    already wraps the host optimizer; ``in_backward`` asks for stepping in backward."""

    in_backward: bool
    allow_in_backward: bool
    allow_host: bool
    allow_streaming: bool = True

    def minima(self, floors: Floors, strategy: str) -> dict[str, int]:
        """Each allowed strategy's floor; a ``strategy`` the rules forbid is refused."""
        minima = floors.peak_bytes()
        if not self.allow_in_backward:
            if self.in_backward or strategy in IN_BACKWARD:
                raise ConfigError(
                    "optimizer_in_backward contradicts allow_optimizer_in_backward=False"
                )
            for name in IN_BACKWARD:
                minima.pop(name, None)
        if not self.allow_host:
            if strategy in (HOST_OPTIMIZER, STREAM_WEIGHTS):
                raise ConfigError(f"{strategy!r} contradicts allow_host_optimizer=False")
            minima.pop(HOST_OPTIMIZER, None)
            minima.pop(STREAM_WEIGHTS, None)
        if not self.allow_streaming:
            if strategy == STREAM_WEIGHTS:
                raise ConfigError(
                    f"{STREAM_WEIGHTS!r} runs on one device: under data parallelism shard the "
                    "weights with FSDP2 (torch.distributed.fsdp.fully_shard) instead"
                )
            minima.pop(STREAM_WEIGHTS, None)
        return minima

    def auto_order(self) -> list[str]:
        """The strategies ``auto`` tries, the cheapest kinds first."""
        if self.in_backward:
            return list(IN_BACKWARD)
        order = ["eager", "recompute", "offload", *IN_BACKWARD, HOST_OPTIMIZER, STREAM_WEIGHTS]
        if not self.allow_in_backward:
            order = [s for s in order if s not in IN_BACKWARD]
        if not self.allow_host:
            order = [s for s in order if s not in (HOST_OPTIMIZER, STREAM_WEIGHTS)]
        if not self.allow_streaming:
            order = [s for s in order if s != STREAM_WEIGHTS]
        return order


def _least_exposed(floors: Floors, order: list[str], budget_bytes: int) -> Choice:
    """``auto``: of the strategies in ``order`` that fit, the one with the least exposed time,
    stepping in backward, state on the host or the host optimizer only where nothing else
    fits; none fits: the least peak."""
    tried = [search_all(floors.profiles, s, budget_bytes, floors.cost, floors.step) for s in order]
    fits = [c for c in tried if c.outcome.peak_bytes <= budget_bytes]
    if not fits:
        return min(tried, key=lambda c: c.outcome.peak_bytes)
    return min(
        fits,
        key=lambda c: (
            bool(c.weights),
            c.host_optimizer,
            c.optimizer_in_backward,
            c.optimizer_on_host,
            c.outcome.extra_compute_s + c.outcome.exposed_s,
        ),
    )


def _plan_of(chosen: Choice, used: Profile, budget_bytes: int, min_budget_bytes: int) -> Plan:
    """The :class:`Plan` of a search's choice on the profile it used."""
    actions, outcome = chosen.actions, chosen.outcome
    unit_bytes = {u.fqn: u.saved_bytes for u in used.units}
    tensors = tuple(
        TensorDecision(s.key, s.unit, actions.get(s.unit, "keep") if s.unit else "keep", s.nbytes)
        for s in used.saved
    )
    streams = outcome.weights
    return Plan(
        units=tuple(
            UnitDecision(
                f,
                a,
                unit_bytes[f],
                segment=chosen.segments.get(f, -1),
                weights="host" if f in chosen.weights else "device",
            )
            for f, a in actions.items()
        ),
        strategy=chosen.strategy,
        budget_bytes=budget_bytes,
        optimizer_in_backward=chosen.optimizer_in_backward,
        predicted_peak_bytes=outcome.peak_bytes,
        min_budget_bytes=min_budget_bytes,
        host_bytes=outcome.host_bytes,
        extra_compute_s=outcome.extra_compute_s,
        transfer_s=outcome.transfer_s,
        feasible=True,
        tensors=tensors,
        resident_bytes=resident_bytes(used, host_optimizer=chosen.host_optimizer)
        - streams.host_bytes,
        largest_unit_bytes=largest_unit_bytes(used),
        optimizer_on_host=chosen.optimizer_on_host,
        optimizer_host_bytes=outcome.optimizer_host_bytes,
        optimizer_copy_s=outcome.optimizer_copy_s,
        head=used.head,
        seq_chunks=used.seq_chunks,
        adapter_inputs=used.adapter_inputs,
        host_optimizer=chosen.host_optimizer,
        grad_buckets=chosen.buckets,
        peak_at=outcome.peak_at,
        breakdown=outcome.breakdown,
        weights_host_bytes=streams.host_bytes,
        streamed_bytes=streams.streamed_bytes,
        weights_exposed_s=streams.exposed_s,
        exposed_transfer_s=outcome.exposed_s,
        # the oldest format that holds the plan: without streamed weights, version 3
        version=PLAN_VERSION if chosen.weights else 3,
    )
