"""Execute a memory :class:`~superneurons.memory.plan.Plan` in an ordinary eager training loop.

``with apply_plan(model, plan): ...`` turns each unit of the plan into what its action says
(docs/CONTRACTS.md): ``keep`` leaves it alone; ``recompute`` runs its forward under
non-reentrant checkpoint with BatchNorm statistics updated once
(:mod:`superneurons.memory.runtime.recompute`, SuperNeurons §3.3); ``offload`` packs its saved
tensors into the Unified Tensor Pool (:mod:`superneurons.memory.offload.pool`, §3.2), which brings
them back one unit ahead of backward; ``recompute+offload`` runs the checkpointed forward
inside the pool, so the one tensor the checkpoint saves (its input) goes to the host and is
prefetched one unit ahead, and the layers between checkpoints are recomputed. With
``plan.optimizer_in_backward`` each parameter is stepped as soon as its gradient is accumulated and
the gradient is freed at once (``Tensor.register_post_accumulate_grad_hook``), and with
``plan.optimizer_on_host`` its state lives in the host pool between steps, fetched one parameter
ahead on the pool's streams (:mod:`superneurons.memory.offload.optim_host`). With
``plan.host_optimizer`` the optimizer itself runs on the host, bucket by bucket as gradients arrive
(:mod:`.host_buckets`, :mod:`.host_optimizer`): the loop's optimizer is ``handle.optimizer`` (whose
``step()`` and ``zero_grad()`` have nothing left to do), and under DDP the plan is applied before
wrapping and ``handle.attach(ddp_model)`` called after.

With ``plan.head`` the model's head + loss runs in chunks of tokens (:mod:`.lmhead`; under
such a plan a causal LM called with labels returns ``logits=None``), and ``plan.seq_chunks``
runs sub-layers over pieces of the sequence (:mod:`.seqchunk`), ``plan.adapter_inputs`` keeps
LoRA adapters' inputs at the base's precision (:mod:`.adapter_inputs`).

The runtime only replaces the ``forward`` attribute of the unit modules (instance attributes,
so the FQNs, ``state_dict`` and module hooks are unchanged) and :meth:`PlanHandle.remove`
restores them exactly.

DDP: apply the plan to the inner module, before or after wrapping it (a
``DistributedDataParallel`` is unwrapped here); non-reentrant checkpoint is DDP-safe. Do not
combine ``optimizer_in_backward`` with DDP: gradients would be stepped before all-reduce.
Autocast: checkpoint replays the autocast state; offloaded tensors keep their dtype.
``torch.compile``: refused unless ``compile="trace"`` (:mod:`superneurons.memory.runtime.compiled`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, cast

import torch
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory.chunked.adapter_inputs import keep_adapter_inputs
from superneurons.memory.chunked.lmhead import HeadHandle, chunk_head
from superneurons.memory.chunked.seqchunk import split_sequence
from superneurons.memory.forwards import ForwardPatches
from superneurons.memory.fsdp import check_sharded_plan, is_fully_sharded
from superneurons.memory.nodes import on_enter, on_leave, output_nodes
from superneurons.memory.offload.host_buckets import GradientBuckets
from superneurons.memory.offload.host_optimizer import HostOptimizerView
from superneurons.memory.offload.optim_backward import WaitingSteps
from superneurons.memory.offload.optim_host import HostOptimizerState
from superneurons.memory.offload.plan_optimizer import attach_optimizer
from superneurons.memory.offload.pool import PoolConfig, PoolStats, TensorPool
from superneurons.memory.offload.weights import WeightStream
from superneurons.memory.plan import OFFLOADING, RECOMPUTING, Plan
from superneurons.memory.profile_types import weightless_backward
from superneurons.memory.runtime.compiled import CompileMode, guard_compiled_calls
from superneurons.memory.runtime.recompute import RecomputeStats, checkpointed_forward
from superneurons.memory.runtime.stateful import guard_stateful_forwards

__all__ = ["PlanHandle", "apply_plan"]

logger = logging.getLogger("superneurons.memory")

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
_MARK = "__superneurons_unit__"


class PlanHandle:
    """A plan applied to a model: a context manager whose exit (or :meth:`remove`) undoes it.

    Attributes:
        plan: the plan being executed.
        pool: the tensor pool of the ``offload`` units.
        recompute_stats: forward/recompute pass counts per ``recompute`` unit fqn.
        optimizers: per-parameter optimizers when ``plan.optimizer_in_backward`` (fqn -> opt).
        host_state: their state in the host pool when ``plan.optimizer_on_host``, else None.
        optimizer: with ``plan.host_optimizer``, the optimizer a training loop holds
            (:class:`~superneurons.memory.offload.host_optimizer.HostOptimizerView`), else None.
        buckets: with ``plan.host_optimizer``, the gradient buckets, else None.
        weights: the streamed units' weights (``UnitDecision.weights == "host"``), else None.
        waiting_steps: with ``plan.optimizer_in_backward`` and a ``plan.step`` that clips or
            accumulates, the steps held to the end of the last micro-batch (its ``sync`` and
            ``grad_norm``), else None.
    """

    def __init__(self, model: nn.Module, plan: Plan, pool: TensorPool) -> None:
        self.model = model
        self.plan = plan
        self.pool = pool
        self.recompute_stats: dict[str, RecomputeStats] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.host_state: HostOptimizerState | None = None
        self.optimizer: HostOptimizerView | None = None
        self.buckets: GradientBuckets | None = None
        self.weights: WeightStream | None = None
        self.waiting_steps: WaitingSteps | None = None
        self._forwards = ForwardPatches()
        self._hooks: list[Any] = []
        self._removed = False

    def _wrap(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        setattr(forward, _MARK, True)
        self._forwards.patch(module, forward)

    def remove(self) -> None:
        """Restore every wrapped module and drop every hook (idempotent)."""
        if self._removed:
            return
        self._forwards.remove()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self.weights is not None:
            self.weights.restore()  # the parameters back on the device
            self.pool.weights = None
        self._removed = True

    def stats(self) -> dict[str, Any]:
        """Pool accounting plus recompute counts: a JSON-friendly snapshot."""
        pool: PoolStats = self.pool.stats()
        return {
            "pool": pool.__dict__.copy(),
            "recompute": {k: v.state_dict() for k, v in self.recompute_stats.items()},
        }

    def attach(
        self, ddp_model: nn.parallel.DistributedDataParallel, *, rebuild: bool = False
    ) -> None:
        """Average gradients over ``ddp_model``'s process group with its communication hook
        (``plan.host_optimizer``; :meth:`GradientBuckets.attach`). Call it on every rank,
        after wrapping the planned model, before the first backward; ``rebuild``: the model
        was wrapped before the plan was applied, and the wrapper is rebuilt in place
        (:mod:`superneurons.memory.offload.rewrap`; :meth:`remove` rebuilds it as it was)."""
        if self.buckets is None:
            raise ConfigError("attach() is for plans with host_optimizer; this plan has none")
        if self.weights is not None:
            raise ConfigError(_STREAMING_ONE_DEVICE)
        self.buckets.attach(ddp_model, rebuild=rebuild)

    def state_dict(self) -> dict[str, Any]:
        state = self._state_dict()
        if self.weights is not None:
            state["weights"] = self.weights.state_dict()
        return state

    def _state_dict(self) -> dict[str, Any]:
        if self.host_state is not None:
            self.host_state.wait()  # the host copies of the optimizer state have landed
        if self.optimizer is not None:
            return {
                "pool": self.pool.state_dict(),
                "recompute": {k: v.state_dict() for k, v in self.recompute_stats.items()},
                "host_optimizer": self.optimizer.state_dict(),
            }
        return {
            "pool": self.pool.state_dict(),
            "recompute": {k: v.state_dict() for k, v in self.recompute_stats.items()},
            "optimizers": {k: v.state_dict() for k, v in self.optimizers.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pool.load_state_dict(state["pool"])
        for fqn, counts in state["recompute"].items():
            self.recompute_stats[fqn].load_state_dict(counts)
        for fqn, opt_state in state.get("optimizers", {}).items():
            self.optimizers[fqn].load_state_dict(opt_state)
        if "weights" in state and self.weights is not None:
            self.weights.load_state_dict(state["weights"])
        if "host_optimizer" in state:
            if self.optimizer is None:
                raise ConfigError("this state has a host optimizer; the plan applied has none")
            self.optimizer.load_state_dict(state["host_optimizer"])

    def __enter__(self) -> PlanHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()


def _narrower_saves(model: nn.Module, plan: Plan) -> list[Any]:
    """Install the plan's sub-layers over pieces of the sequence and its kept adapter inputs:
    their handles."""
    handles: list[Any] = []
    try:
        if plan.seq_chunks:
            handles.append(split_sequence(model, plan.seq_chunks))
        if plan.adapter_inputs:
            handles.append(keep_adapter_inputs(model, plan.adapter_inputs))
    except BaseException:
        for handle in reversed(handles):
            handle.remove()
        raise
    return handles


def apply_plan(
    model: nn.Module,
    plan: Plan,
    *,
    device: torch.device | str | None = None,
    pool_config: PoolConfig | None = None,
    optimizer_factory: OptimizerFactory | None = None,
    compile: CompileMode = "refuse",
) -> PlanHandle:
    """Execute ``plan`` on ``model`` until the returned handle is removed.

    Args:
        model: any ``nn.Module`` (a DDP wrapper is unwrapped); unit fqns are relative to it.
        plan: per-unit actions (``make_plan`` or hand-made).
        device: where activations live (default: the device of the first parameter).
        pool_config: tensor-pool options; by default its slab is preallocated with
            ``plan.host_bytes``.
        optimizer_factory: builds one optimizer for a list of parameters; required when
            ``plan.optimizer_in_backward`` (then call no ``optimizer.step()`` yourself) and
            when ``plan.host_optimizer`` (then use ``handle.optimizer`` as the loop's).
        compile: ``"refuse"`` (default): a ``torch.compile``-d call of the model or of a plan
            unit raises ``ConfigError`` (the budget holds for the eager step the profile saw);
            ``"trace"``: the hooks trace without a graph break of their own, recompute units
            become dynamo's traced checkpoint, and the budget is measured, not promised
            (:mod:`superneurons.memory.runtime.compiled`).

    Raises:
        ConfigError: a unit fqn is not a submodule, non-keep units are nested, the model
            already runs a plan, ``optimizer_in_backward`` lacks ``optimizer_factory``,
            (``compile="refuse"``) at the first compiled call, or the model is
            ``fully_shard``-ed (FSDP2) and the plan offloads or moves the optimizer
            (:func:`superneurons.memory.fsdp.check_sharded_plan`).
    """
    if isinstance(model, nn.parallel.DistributedDataParallel):
        if plan.streams_weights:
            raise ConfigError(_STREAMING_ONE_DEVICE)
        model = model.module
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    config = pool_config or PoolConfig(host_bytes=plan.host_bytes)

    if is_fully_sharded(model):
        check_sharded_plan(model, plan)
    units = _resolve_units(model, plan)
    if any(getattr(m.forward, _MARK, False) for _, _, m in units):
        raise ConfigError("this model already runs a plan: remove() the first handle")

    def model_state() -> Iterable[torch.Tensor]:
        yield from model.parameters()
        yield from model.buffers()

    pool = TensorPool(config, device=device, excluded=model_state)
    handle = PlanHandle(model, plan, pool)
    trace = _CallTrace()
    head = chunk_head(model, plan.head) if plan.head is not None else None  # checks, then patches
    handle._hooks += [head] if head is not None else []
    try:
        handle._hooks += _narrower_saves(model, plan)
        handle._hooks += guard_compiled_calls(model, plan, mode=compile)
        for unit in plan.units:  # every unit call, keep units included, in forward order
            hook = model.get_submodule(unit.fqn).register_forward_pre_hook(
                lambda _m, _a, a=unit.action: trace.enter(a)
            )
            handle._hooks.append(hook)
        for fqn, action, module in units:
            if action == "recompute":
                stats = handle.recompute_stats.setdefault(fqn, RecomputeStats())
                handle._wrap(module, checkpointed_forward(module, module.forward, stats))
            elif action == "offload":
                handle._wrap(module, _offloaded_forward(pool, module.forward, trace))
            elif action == "recompute+offload":
                # the checkpoint's input goes to the pool; the previous checkpoint is
                # prefetched once this unit's recompute has finished
                stats = handle.recompute_stats.setdefault(fqn, RecomputeStats())
                inner = checkpointed_forward(module, module.forward, stats)
                forward = _offloaded_forward(pool, inner, trace, after_first_node=True)
                handle._wrap(module, forward)
        for members in _segments(model, plan):
            _wrap_segment(handle, members)
        if plan.optimizer_in_backward or plan.host_optimizer:
            attach_optimizer(handle, model, optimizer_factory)
        if plan.streams_weights:
            _stream_weights(handle, model, device, head)
        handle._hooks += guard_stateful_forwards(model, plan)  # HF cache, state in forward
    except BaseException:
        handle.remove()
        raise
    logger.info(
        "plan applied: %d keep, %d offload, %d recompute, %d recompute+offload units, "
        "optimizer_in_backward=%s",
        plan.count("keep"),
        plan.count("offload"),
        plan.count("recompute"),
        plan.count("recompute+offload"),
        plan.optimizer_in_backward,
    )
    return handle


_STREAMING_ONE_DEVICE = (
    "this plan streams weights from the host, which runs on one device: under data "
    "parallelism shard the weights with FSDP2 (torch.distributed.fsdp.fully_shard) instead, or "
    "plan with allow_weight_streaming=False"
)


def _stream_weights(
    handle: PlanHandle, model: nn.Module, device: torch.device, head: HeadHandle | None
) -> None:
    """Keep the streamed units' parameters in the host pool, with device copies around their
    forward and backward (:mod:`superneurons.memory.offload.weights`); the host optimizer reads
    and writes the trainable ones there. A head plan with ``vocab_rows`` whose unit streams
    reads the head's weight in slices (:mod:`superneurons.memory.offload.slices`), and its
    gradient reaches the host optimizer on the host."""
    plan = handle.plan
    in_segment = [u.fqn for u in plan.units if u.weights == "host" and u.segment >= 0]
    if in_segment:
        raise ConfigError(
            f"units {in_segment[:3]} stream their weights and sit in a recompute segment, whose "
            "first unit runs them past their windows: give them segment -1"
        )
    sliced = _sliced_head(model, plan)
    forward_only = [
        u.fqn
        for u in plan.units
        if u.weights == "host"
        and u.action not in RECOMPUTING
        and weightless_backward(model.get_submodule(u.fqn))
    ]
    stream = WeightStream(
        model,
        plan.streamed_units(),
        all_units=[u.fqn for u in plan.units],
        device=device,
        sliced=sliced,
        forward_only=forward_only,
    )
    trainable = [w.fqn for w in stream.weights if w.param.requires_grad]
    if trainable and handle.buckets is None:
        raise ConfigError(
            f"streamed parameters {trainable[:3]} take gradients: their optimizer must run on the "
            "host (plan.host_optimizer), which updates the host copy the next fetch carries"
        )
    for weight in stream.weights:
        if weight.param.requires_grad and handle.buckets is not None:
            handle.buckets.optimizer.retarget(weight.fqn, weight.host)
    for param in sliced:
        rows = stream.rows_of(param)
        assert head is not None and rows is not None  # _sliced_head: a head plan
        head.rows = rows
        fqns = [w.fqn for w in stream.weights if w.param is param and param.requires_grad]
        if fqns and handle.buckets is not None:  # its gradient is made on the host
            rows.deliver = handle.buckets.grads_on_host(fqns[0], rows.ready_event)
    stream.move_to_host()
    handle.weights = stream
    handle.pool.weights = stream
    for index, fqn in enumerate(stream.units):
        module = model.get_submodule(fqn)
        handle._wrap(module, stream.forward_of(index, module.forward))


def _sliced_head(model: nn.Module, plan: Plan) -> list[nn.Parameter]:
    """The LM head's weight when the plan reads it in vocabulary slices and its unit streams."""
    if plan.head is None or not plan.head.vocab_rows:
        return []
    streamed = set(plan.streamed_units())
    fqn = plan.head.fqn
    if not any(fqn == u or fqn.startswith(u + ".") for u in streamed):
        return []  # resident: the loss reads views of the weight
    return [cast(nn.Parameter, cast(nn.Linear, model.get_submodule(fqn)).weight)]


def _resolve_units(model: nn.Module, plan: Plan) -> list[tuple[str, str, nn.Module]]:
    units: list[tuple[str, str, nn.Module]] = []
    for unit in plan.units:
        try:
            module = model.get_submodule(unit.fqn)
        except AttributeError as exc:
            raise ConfigError(
                f"plan unit {unit.fqn!r} is not a submodule of {type(model).__name__}: "
                "the plan was made for another model; re-profile and re-plan this one"
            ) from exc
        if unit.action != "keep":
            units.append((unit.fqn, unit.action, module))
    active = [fqn for fqn, _, _ in units]
    for fqn, _, module in units:
        if any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules()):
            raise ConfigError(
                f"plan unit {fqn!r} runs under Hugging Face gradient checkpointing: turn it off "
                "(model.gradient_checkpointing_disable()); the plan recomputes where the "
                "budget needs it"
            )
    for outer in active:
        for inner in active:
            if inner != outer and (outer == "" or inner.startswith(outer + ".")):
                raise ConfigError(
                    f"plan units {outer!r} and {inner!r} are nested: give the inner one 'keep'"
                )
    return units


def _segments(model: nn.Module, plan: Plan) -> list[list[tuple[str, nn.Module]]]:
    """Runs of recompute units the plan groups into segments, when the runtime can honour them:
    consecutive children of one ``nn.Sequential`` (else the segment is ignored, which is
    correct but uses more memory than the plan predicts)."""
    groups: dict[int, list[str]] = {}
    for unit in plan.units:
        if getattr(unit, "segment", -1) >= 0 and unit.action == "recompute":
            groups.setdefault(unit.segment, []).append(unit.fqn)
    runs = []
    for segment, fqns in sorted(groups.items()):
        parents = {f.rpartition(".")[0] for f in fqns}
        parent = model.get_submodule(next(iter(parents))) if len(parents) == 1 else None
        names = [f.rpartition(".")[2] for f in fqns]
        children = list(parent._modules) if isinstance(parent, nn.Sequential) else []
        start = children.index(names[0]) if names[0] in children else -1
        if len(fqns) < 2 or start < 0 or children[start : start + len(names)] != names:
            logger.warning(
                "segment %d (%s) ignored: not consecutive Sequential children",
                segment,
                ", ".join(fqns),
            )
            continue
        runs.append([(f, model.get_submodule(f)) for f in fqns])
    return runs


def _wrap_segment(handle: PlanHandle, members: list[tuple[str, nn.Module]]) -> None:
    """One outer non-reentrant checkpoint around the segment's members (each keeping its own,
    nested): only the segment's input stays saved (memory-centric recomputation, SuperNeurons
    §3.3; Chen et al. 2016). The first member runs the whole chain; the others, still called
    by their ``nn.Sequential``, pass their input through."""
    inner = [module.forward for _, module in members]  # the members' checkpointed forwards

    def chain(x: Any) -> Any:
        for forward in inner:
            x = forward(x)
        return x

    first_fqn, first = members[0]
    stats = handle.recompute_stats.setdefault(first_fqn + "+segment", RecomputeStats())
    others = [module for _, module in members[1:]]
    handle._wrap(first, checkpointed_forward(first, chain, stats, also=others))
    for module in others:
        handle._wrap(module, _passthrough)


def _passthrough(x: Any) -> Any:
    return x


class _CallTrace:
    """The actions of the last two plan-unit calls in forward order (keep units included).

    A module called several times in one forward (a ResNet bottleneck's one ``ReLU``) is a
    different neighbour at each call: whether the previous pool group is prefetched one ahead
    depends on the unit *call* just before, as :func:`superneurons.memory.planner.predict.evaluate`
    assumes, not on the unit's place in the plan.
    """

    def __init__(self) -> None:
        self.previous = self.current = "keep"

    def enter(self, action: str) -> None:
        self.previous, self.current = self.current, action


def _offloaded_forward(
    pool: TensorPool,
    forward: Callable[..., Any],
    trace: _CallTrace,
    *,
    after_first_node: bool = False,
) -> Callable[..., Any]:
    """Run ``forward`` with its saved tensors packed into ``pool``; arm the prefetch (of the
    previous unit call's group too when that call is offloaded as well: ``chained``).

    ``after_first_node`` (recompute+offload): the previous unit's group is prefetched when
    backward leaves this unit's output node, i.e. once the recompute that node's unpack
    triggered is over and its transient buffers are gone, so the copy is not live during the
    recompute's peak and still overlaps the rest of this unit's backward.
    """

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        chained = trace.previous in OFFLOADING  # the unit call just before this one
        with pool.offloading() as group:
            out = forward(*args, **kwargs)
        # When backward reaches this unit's outputs, bring this unit's tensors and the
        # previous unit's back (autograd-node pre-hooks: memory.nodes)
        nodes = output_nodes(out)
        previous = chained and not after_first_node
        on_enter(nodes, functools.partial(pool.backward_entered, group, previous=previous))
        if chained and after_first_node:
            on_leave(nodes, functools.partial(pool.backward_entered, group - 1, previous=False))
        return out

    return wrapped
