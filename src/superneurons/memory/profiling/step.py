"""Profile one training step: every saved activation, its liveness, and the memory timeline.

:func:`profile_step` runs forward, backward and the optimizer step of any ``nn.Module``,
isolated (:mod:`.isolate`: the caller's state is untouched), with three observers:

* :class:`~superneurons.memory.tracker.LiveStorageTracker` counts live storages op by op (the
  *events* of the execution route) and gives each storage its birth and death event;
* ``torch.autograd.graph.saved_tensors_hooks`` see every tensor autograd saves: its key
  (innermost module fqn, call index, ordinal), size, pack event and last unpack event;
* module pre/post hooks give each *unit* (a module whose saved tensors a plan treats together)
  its forward window, forward FLOPs (``torch.utils.flop_counter``'s formulas), bytes written,
  and where backward enters and leaves it (the runtime's prefetch points, :mod:`.nodes`).

The observers' bookkeeping lives in :mod:`.recording`, the record it becomes in
:mod:`.from_recording`. This is
SuperNeurons' liveness analysis over the execution route (Wang et al., PPoPP'18 §3.1),
measured rather than derived from a static graph: branches, shared modules, in-place ops,
dropout and BatchNorm need no special cases. With ``fake=True`` the step runs under
``FakeTensorMode`` on fake *cpu* tensors: byte sizes are exact, nothing is allocated.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from superneurons.errors import ConfigError
from superneurons.memory.fsdp import count_unsharded_params, is_fully_sharded, with_lineage
from superneurons.memory.planner.cost import EventTimer, measure_copy_bandwidth
from superneurons.memory.profile_types import (
    ALLOCATOR_MARGIN_BYTES,
    CATEGORIES,
    Profile,
    SavedTensor,
    UnitProfile,
    default_units,
    head_unit,
    unit_params,
    weightless_backward,
)
from superneurons.memory.profiling.from_recording import build_profile
from superneurons.memory.profiling.isolate import IsolationError, isolated, unwrapped
from superneurons.memory.profiling.owners import kept_in_place, with_owners
from superneurons.memory.profiling.recording import Recorder
from superneurons.memory.profiling.weights import weight_state_tensors
from superneurons.memory.profiling.workspace import op_scratch, scratch_recorder
from superneurons.memory.runtime.recompute import running_stat_bytes
from superneurons.memory.runtime.stateful import kv_cache_off
from superneurons.memory.tracker import LiveStorageTracker

__all__ = [
    "CATEGORIES",
    "Profile",
    "SavedTensor",
    "UnitProfile",
    "output_loss",
    "profile_step",
]

logger = logging.getLogger("superneurons.memory")

LossFn = Callable[[Any, Any], torch.Tensor]


def profile_step(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    fake: bool = False,
    units: Sequence[str] | None = None,
    fake_mode: Any = None,
    keep_output: bool = True,
    prepare: Callable[[nn.Module], Any] | None = None,
    carry_output: bool = False,
    autocast: torch.dtype | None = None,
) -> Profile:
    """Profile one training step (forward, ``loss_fn(output, targets)``, backward, optimizer step).

    The step runs isolated (:func:`~superneurons.memory.profiling.isolate.isolated`): on the
    caller's own module tree with its trainable parameters and buffers swapped for clones, gradients
    from ``None``, and a shadow of the innermost optimizer; afterwards the caller's parameters,
    gradients, buffers, optimizer, LR scheduler and RNG are as they were. A real profile needs
    room for a copy of the trainable parameters and optimizer state (``fake=True`` does not).

    Args:
        units: fqns of the modules a plan decides for; default :func:`default_units` (the
            non-container children of ``nn.Sequential``/``nn.ModuleList`` containers, e.g.
            residual blocks and transformer blocks).
        fake_mode: an existing ``FakeTensorMode`` when model and inputs are already fake.
        keep_output: the step holds the model's output through backward, as a loop that
            keeps ``output = model(x)`` in scope does (``train/loop.py``, ``bench memory``);
            ``False`` for ``loss_fn(model(x), y).backward()``, which frees whatever autograd
            did not save (for GPT-2 124M at B=8, T=1024: 1.53 GiB of logits). HF's ``Trainer``
            frees the outputs before backward: ``False``.
        prepare: applied to the isolated module tree before the step runs; returns a handle
            whose ``remove()`` undoes it, called before isolation ends (e.g.
            ``memory.profiling.below`` chunks the LM head).
        carry_output: (with ``keep_output``) the loop's variable keeps the output through the
            optimizer step and, in steady state, through the next step's forward until it is
            reassigned: ``outputs = model(**batch); outputs.loss.backward(); opt.step()`` in
            HF's ``no_trainer`` examples. The output's bytes are then counted from the first
            event to the end of the model's forward as well (``Profile.carried_output_bytes``).
        autocast: run the forward and the loss under ``torch.autocast(device, dtype=autocast)``
            and backward and the optimizer step outside it, as mixed-precision loops are
            written (PyTorch's AMP recipe). Called inside an enabled ``torch.autocast`` block,
            the step is profiled the same way with that block's dtype: backward and the step
            of the real loop run outside it.

    ``inputs`` that are a mapping are passed as keyword arguments (``model(**batch)``, the HF
    style; use :func:`output_loss` as ``loss_fn`` to read ``outputs.loss``).

    Raises:
        ConfigError: the step fails under fake tensors (data-dependent ops such as ``nonzero`` or
            ``.item()``); profile with real tensors (``fake=False``); ``optimizer`` is not a torch
            optimizer (nor wraps one).
        IsolationError: the step changed one of the caller's tensors in place outside the
            module tree (see :mod:`superneurons.memory.profiling.isolate`).
    """
    model = unwrapped(model)
    unit_fqns = set(default_units(model) if units is None else units)
    missing = sorted(unit_fqns - set(dict(model.named_modules())))
    if missing:
        raise ConfigError(
            f"units {missing} are not submodules of the model: use fqns from named_modules()"
        )
    mode, inputs, targets = _fake_mode(model, fake, fake_mode, (inputs, targets))
    device_type = _device_type(model, fake=mode is not None)
    if autocast is None and torch.is_autocast_enabled(device_type):
        autocast = torch.get_autocast_dtype(device_type)  # the caller's, around forward + loss
    try:
        with (
            isolated(model, optimizer, fake_mode=mode) as (model_c, opt_c),
            mode if mode is not None else contextlib.nullcontext(),
        ):
            prepared = prepare(model_c) if prepare is not None else None
            try:
                return _run(
                    model_c,
                    opt_c,
                    inputs,
                    targets,
                    loss_fn,
                    unit_fqns,
                    fake=mode is not None,
                    keep_output=keep_output,
                    carry_output=carry_output,
                    autocast=autocast,
                )
            finally:
                if prepared is not None:
                    prepared.remove()
    except (RuntimeError, NotImplementedError) as exc:
        if mode is None or isinstance(exc, IsolationError):
            raise
        raise ConfigError(
            f"the training step fails under fake tensors ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]}); data-dependent ops (nonzero, .item(), boolean "
            "masks) need real values: profile with real tensors (fake=False)"
        ) from exc


def _fake_mode(model: nn.Module, fake: bool, fake_mode: Any, batch: tuple[Any, Any]) -> Any:
    """The ``FakeTensorMode`` the step runs under (None: real tensors), and the batch in it: a
    new mode for ``fake=True``, the caller's for a model that is fake already."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = fake_mode
    already_fake = _is_fake(next(iter(model.parameters()), None))
    if fake and mode is None and not already_fake:
        mode = FakeTensorMode(allow_non_fake_inputs=False)
    if already_fake and mode is None:
        raise ConfigError("the model's parameters are fake: pass the FakeTensorMode as fake_mode=")
    if mode is not None and not already_fake:
        batch = tree_map(_to_fake(mode), batch)
    return mode, *batch


def _is_fake(tensor: torch.Tensor | None) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def _to_fake(mode: Any) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        return mode.from_tensor(value) if isinstance(value, torch.Tensor) else value

    return convert


def _run(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    inputs: Any,
    targets: Any,
    loss_fn: LossFn,
    unit_fqns: set[str],
    *,
    fake: bool,
    keep_output: bool = True,
    carry_output: bool = False,
    autocast: torch.dtype | None = None,
) -> Profile:
    # a real cpu step: the allocator's own view too, for the scratch kernels allocate
    on_cpu = not fake and _device_type(model, fake=fake) == "cpu"
    tracker = LiveStorageTracker(record_timeline=False, mark_ops=on_cpu)
    rec = Recorder(tracker, unit_fqns)
    tracker._on_op = rec.on_op  # type: ignore[assignment]
    first = next(iter(model.parameters()), None)
    if not fake and first is not None and first.device.type == "cuda":
        rec.timer = EventTimer()
    ready: dict[str, int] = {}  # parameter fqn -> the event its gradient was accumulated at
    handles = _watch(model, rec, ready)
    _register_resident(tracker, rec, model, optimizer, (inputs, targets))
    recording = scratch_recorder(on_cpu)
    start_s = time.perf_counter()
    try:
        with recording:
            events, carried = _step(
                model, optimizer, inputs, targets, loss_fn, rec, fake=fake,
                keep_output=keep_output, carry_output=carry_output, autocast=autocast,
            )  # fmt: skip
    finally:
        for handle in handles:
            handle.remove()
    step_s = time.perf_counter() - start_s
    bandwidth = _unit_facts(model, rec)
    if is_fully_sharded(model):  # every life of a resized parameter storage (FSDP2's reshard)
        rec.param_storages = with_lineage(tracker, rec.param_storages)
    grad_names = {
        tracker.serial_of(p.grad): fqn for fqn, p in model.named_parameters() if p.grad is not None
    }
    grad_names.pop(None, None)
    opt_state = {tracker.serial_of(t) for t in _optimizer_tensors(optimizer)} - {None}
    profile = build_profile(
        rec,
        # forward order (the runtime's one-ahead prefetch and the planner rely on it)
        unit_order=sorted(rec.unit_rows, key=lambda f: rec.unit_rows[f]["fwd_start"]),
        grad_storages=set(grad_names),  # type: ignore[arg-type]
        opt_storages=opt_state,  # type: ignore[arg-type]
        events=events,
        fake=fake,
        step_s=step_s,
        copy_bytes_per_s=bandwidth,
        head_unit=head_unit(model, unit_fqns),
        carried_storages=carried,
        scratch=op_scratch(recording) if on_cpu else {},
        # NOTE: checkpoint stashes the cpu generator's state per call (preserve_rng_state);
        # on a cuda device that tensor is host memory
        rng_state_bytes=int(torch.get_rng_state().numel()) if on_cpu else 0,
        margin_bytes=ALLOCATOR_MARGIN_BYTES if on_cpu else 0,
    )
    owned = with_owners(
        profile,
        rec,
        grad_names=grad_names,  # type: ignore[arg-type]
        opt_storages=opt_state,  # type: ignore[arg-type]
        grad_ready=ready,
        param_numel=sum(p.numel() for p in model.parameters() if p.requires_grad),
        frozen_bytes=_frozen_bytes(model),
    )
    weightless = tuple(f for f in unit_fqns if weightless_backward(model.get_submodule(f)))
    return replace(owned, unit_params=unit_params(model, unit_fqns), weightless_backward=weightless)


def _frozen_bytes(model: nn.Module) -> int:
    """Storage bytes of the parameters that take no gradient (each storage once)."""
    storages = {
        p.untyped_storage()._cdata: p.untyped_storage().nbytes()
        for p in model.parameters()
        if not p.requires_grad
    }
    return sum(storages.values())


def _watch(model: nn.Module, rec: Recorder, ready: dict[str, int]) -> list[Any]:
    """The hooks that record the step: every module's forward (the units' windows), the key /
    value caches off as under a plan, FSDP2's unsharded parameters counted as parameters, and
    the event each parameter's gradient is accumulated at (into ``ready``). Returns their
    handles."""
    handles = []
    for fqn, module in model.named_modules():
        handles.append(
            module.register_forward_pre_hook(
                lambda _m, a, k, f=fqn: rec.pre(f, (a, k)), with_kwargs=True
            )
        )
        handles.append(module.register_forward_hook(lambda _m, _a, out, f=fqn: rec.post(f, out)))
    handles += kv_cache_off(model)  # HF use_cache=False in training, as under a plan
    if is_fully_sharded(model):  # FSDP2's unsharded parameters are parameters, not activations
        handles += count_unsharded_params(model, rec.tracker, rec.param_storages)

    def accumulated(fqn: str) -> None:
        ready.setdefault(fqn, rec.tracker.event)

    for fqn, param in model.named_parameters():
        if param.requires_grad:
            handles.append(
                param.register_post_accumulate_grad_hook(lambda _p, f=fqn: accumulated(f))
            )
    return handles


def _register_resident(
    tracker: LiveStorageTracker,
    rec: Recorder,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    batch: Any,
) -> None:
    """What is alive before the step: parameters and buffers (with what quantized parameters
    hold beside their data: :mod:`.weights`), optimizer state, the batch."""
    params = [*model.parameters(), *model.buffers(), *weight_state_tensors(model)]
    leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    tracker.register(params)
    rec.param_storages.update({tracker.serial_of(p) for p in params} - {None})  # type: ignore[arg-type]
    tracker.register(_optimizer_tensors(optimizer))
    tracker.register(leaves)


def _step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    inputs: Any,
    targets: Any,
    loss_fn: LossFn,
    rec: Recorder,
    *,
    fake: bool,
    keep_output: bool,
    carry_output: bool,
    autocast: torch.dtype | None,
) -> tuple[dict[str, int], set[int]]:
    """The training step as the user's loop runs it, counted op by op: forward and loss (under
    ``autocast``), backward, the optimizer step. Returns where each phase ended, and the
    storages of the output the loop's variable carries past the step."""
    tracker, events = rec.tracker, {}
    device_type = _device_type(model, fake=fake)
    forward_autocast = torch.autocast(device_type, dtype=autocast, enabled=autocast is not None)
    # backward and the step run outside the user's autocast (an enclosing one included)
    no_autocast = torch.autocast(device_type, enabled=False)
    with tracker, torch.autograd.graph.saved_tensors_hooks(_pack(rec), rec.unpack):
        with forward_autocast:
            output = _call(model, inputs)
            events["model_end"] = tracker.event
            loss = loss_fn(output, targets)
        if autocast is not None:  # the user's block ends here (an enclosing one too)
            torch.clear_autocast_cache()
        if not keep_output:  # ``loss_fn(model(x), y).backward()``: only what autograd saved
            del output
        events["forward_end"] = tracker.event
        rec.phase = "backward"
        with no_autocast:
            loss.backward()
        del loss
        carried: set[int] = set()
        if keep_output and carry_output:  # the loop's variable holds it past the step
            carried = _storages(tracker, output)
        else:
            output = None  # the step's output is released with the loss
        events["backward_end"] = tracker.event
        rec.phase = "step"
        if optimizer is not None:
            with no_autocast:
                optimizer.step()
        events["step_end"] = tracker.event
    return events, carried


def _unit_facts(model: nn.Module, rec: Recorder) -> tuple[float, float]:
    """Per unit: the running statistics its recompute snapshots, whether it sits in an
    ``nn.Sequential`` (segments), and on CUDA its measured forward time. Returns the measured
    copy rates ``(d2h, h2d)`` bytes/s (zeros off CUDA)."""
    for fqn, row in rec.unit_rows.items():
        row["norm_state_bytes"] = running_stat_bytes(model.get_submodule(fqn))
        parent = model.get_submodule(fqn.rpartition(".")[0]) if fqn else None
        row["in_sequential"] = isinstance(parent, nn.Sequential)
    if rec.timer is None:
        return (0.0, 0.0)
    for fqn, seconds in rec.timer.seconds().items():
        if fqn in rec.unit_rows:
            rec.unit_rows[fqn]["time_s"] = seconds
    first = next(iter(model.parameters()))
    return measure_copy_bandwidth(first.device)


def _pack(rec: Recorder) -> Callable[[torch.Tensor], Any]:
    """``rec.pack``, marking the saves the tensor pool keeps on the device."""

    def pack(tensor: torch.Tensor) -> Any:
        packed = rec.pack(tensor)
        if packed[0] is not None and kept_in_place(tensor):
            rec.saved[packed[0]]["pool_keeps"] = True
        return packed

    return pack


def _storages(tracker: LiveStorageTracker, value: Any) -> set[int]:
    """Serials of the tracked storages of the tensors in ``value`` (a pytree or a ModelOutput)."""
    if isinstance(value, Mapping):  # HF's ModelOutput is an OrderedDict
        value = dict(value)
    found = {tracker.serial_of(t) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)}
    return {s for s in found if s is not None}


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping) and _takes(model, inputs):  # ``model(**batch)``
        return model(**inputs)
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


def _takes(model: nn.Module, batch: Mapping[str, Any]) -> bool:
    """The forward names the batch's keys (HF models), or takes only ``*args, **kwargs`` (a
    wrapper passing them on: PEFT's ``PeftModel``): called with them as keywords; else the
    mapping is the one positional input (a step wrapper's ``forward(batch)``)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return False
    kinds = {p.kind for p in params.values()}
    passes_on = kinds == {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}
    return passes_on or any(key in params for key in batch)


def _device_type(model: nn.Module, *, fake: bool) -> str:
    """Where the step's autocast applies: fake tensors are cpu tensors."""
    first = next(iter(model.parameters()), None)
    return "cpu" if fake or first is None else first.device.type


def output_loss(output: Any, _targets: Any = None) -> torch.Tensor:
    """``loss_fn`` for models that compute their own loss: ``output.loss`` (HF ``ModelOutput``,
    or a dict with ``"loss"``).

    Raises:
        ConfigError: the output holds no loss (a causal LM needs ``labels`` in the batch).
    """
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(
            "the model returned no loss for the sample batch: include the labels in it "
            "(e.g. batch['labels'] = batch['input_ids'] for a causal LM)"
        )
    return loss


def _optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    states = optimizer.state.values() if optimizer is not None else ()
    return [v for state in states for v in tree_flatten(state)[0] if isinstance(v, torch.Tensor)]
