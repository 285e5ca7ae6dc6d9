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

This is SuperNeurons' liveness analysis over the execution route (Wang et al., PPoPP'18 §3.1),
measured rather than derived from a static graph: branches, shared modules, in-place ops,
dropout and BatchNorm need no special cases. With ``fake=True`` the step runs under
``FakeTensorMode`` on fake *cpu* tensors: byte sizes are exact, nothing is allocated.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from superneurons.errors import ConfigError
from superneurons.memory.cost import EventTimer, measure_copy_bandwidth
from superneurons.memory.isolate import IsolationError, isolated, unwrapped
from superneurons.memory.nodes import on_enter, on_leave, output_nodes
from superneurons.memory.profile_types import (
    CATEGORIES,
    Profile,
    SavedTensor,
    UnitProfile,
    default_units,
)
from superneurons.memory.recompute import running_stat_bytes
from superneurons.memory.stateful import kv_cache_off
from superneurons.memory.tracker import LiveStorageTracker

__all__ = ["CATEGORIES", "Profile", "SavedTensor", "UnitProfile", "profile_step"]

logger = logging.getLogger("superneurons.memory")

LossFn = Callable[[Any, Any], torch.Tensor]


class _Recorder:
    """Mutable bookkeeping of one profiled step (module stack, saved tensors, unit windows)."""

    def __init__(self, tracker: LiveStorageTracker, units: set[str]) -> None:
        self.tracker = tracker
        self.units = units
        self.stack: list[tuple[str, int]] = []  # (fqn, call index)
        self.calls: dict[str, int] = {}
        self.ordinals: dict[tuple[str, int], int] = {}
        self.param_storages: set[int] = set()
        self.saved: list[dict[str, Any]] = []
        self.first_key_of_storage: dict[int, str] = {}
        self.unit_rows: dict[str, dict[str, Any]] = {}
        self.op_of_storage: dict[int, str] = {}
        self.saved_by_unit: dict[str, set[int]] = {}
        self.phase = "forward"
        self.timer: EventTimer | None = None  # CUDA events per unit forward (real CUDA runs)

    # module hooks --------------------------------------------------------------------------
    def pre(self, fqn: str, args: Any = ()) -> None:
        call = self.calls.get(fqn, 0)
        self.calls[fqn] = call + 1
        self.stack.append((fqn, call))
        if fqn in self.units:
            row = self.unit_rows.setdefault(
                fqn,
                dict(
                    fwd_start=self.tracker.event + 1,
                    fwd_end=-1,
                    bwd_start=-1,
                    flops=0,
                    written=0,
                    live_at_start=self.tracker.live_bytes,
                    temp_peak=0,
                    time_s=0.0,
                    t0=0.0,
                    calls=[],
                ),
            )
            # per call: [fwd_start, fwd_end, bwd_start, bwd_end] (a module called several
            # times in one forward, e.g. a ResNet bottleneck's one ReLU, has several windows)
            row["calls"].append([self.tracker.event + 1, -1, -1, -1])
            row["t0"] = time.perf_counter()
            row["in_sids"] = {
                self.tracker.serial_of(t)
                for t in tree_flatten(args)[0]
                if isinstance(t, torch.Tensor)
            } - {None}
            row.setdefault("first_in_sids", row["in_sids"])
            if self.timer is not None:
                row["events"] = self.timer.start()

    def post(self, fqn: str, output: Any) -> None:
        if self.stack and self.stack[-1][0] == fqn:
            self.stack.pop()
        if fqn in self.units:
            row = self.unit_rows[fqn]
            # outputs the unit also saved are re-created by its recompute: not counted here
            saved_here = self.saved_by_unit.get(fqn, set())
            outs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
            out_sids = {self.tracker.serial_of(t) for t in outs}
            row["out_bytes"] = sum(
                t.untyped_storage().nbytes()
                for t in outs
                if self.tracker.serial_of(t) not in saved_here
            )
            row["inplace"] = row.get("inplace", False) or bool(out_sids & row["in_sids"])
            row["fwd_end"] = self.tracker.event
            row["calls"][-1][1] = self.tracker.event
            # where backward enters and leaves this call's output nodes (the runtime's
            # prefetch points): [enter, leave] events per call
            row.setdefault("edges", []).append([-1, -1])
            call, nodes = len(row["calls"]) - 1, output_nodes(outs)
            on_enter(nodes, lambda: self.reached(fqn, call, 0))
            on_leave(nodes, lambda: self.reached(fqn, call, 1))
            if self.timer is not None:
                self.timer.stop(fqn, row.pop("events"))
            else:
                row["time_s"] += time.perf_counter() - row["t0"]

    def reached(self, fqn: str, call: int, side: int) -> None:
        edges = self.unit_rows[fqn]["edges"][call]  # the first hook to fire: the runtime's
        edges[side] = edges[side] if edges[side] >= 0 else self.tracker.event  # prefetch point

    def current_unit(self) -> str:
        return self.current_call()[0]

    def current_call(self) -> tuple[str, int]:
        """The innermost unit running and the index of its current call ("", 0: none)."""
        for fqn, _ in reversed(self.stack):
            if fqn in self.units:
                return fqn, len(self.unit_rows[fqn]["calls"]) - 1
        return "", 0

    # dispatch callback ---------------------------------------------------------------------
    def on_op(self, event: int, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        name = str(func.overloadpacket.__name__)
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                sid = self.tracker.serial_of(leaf)
                if sid is not None:
                    self.op_of_storage.setdefault(sid, name)
        if self.phase != "forward" or not self.stack:
            return
        unit = self.current_unit()
        if not unit:
            return
        row = self.unit_rows[unit]
        packet = func.overloadpacket
        if packet in flop_registry:
            row["flops"] += int(flop_registry[packet](*args, **(kwargs or {}), out_val=out))
        row["written"] += sum(
            t.numel() * t.element_size()
            for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor)
        )
        row["temp_peak"] = max(row["temp_peak"], self.tracker.live_bytes - row["live_at_start"])

    # saved-tensor hooks --------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Any:
        sid = self.tracker.serial_of(tensor)
        if sid is None or sid in self.param_storages or self.phase != "forward":
            return (None, tensor)
        fqn, call = self.stack[-1] if self.stack else ("", 0)
        ordinal = self.ordinals.get((fqn, call), 0)
        self.ordinals[(fqn, call)] = ordinal + 1
        key = f"{fqn}#{call}:{ordinal}"
        first = sid not in self.first_key_of_storage
        if first:
            self.first_key_of_storage[sid] = key
        index = len(self.saved)
        unit, unit_call = self.current_call()
        self.saved_by_unit.setdefault(unit, set()).add(sid)
        if unit:  # a recompute stops at its last save (early stop): its peak up to here
            self.unit_rows[unit]["recompute_peak"] = self.unit_rows[unit]["temp_peak"]
        self.saved.append(
            dict(
                key=key,
                module=fqn,
                sid=sid,
                first=first,
                unit=unit,
                unit_call=unit_call,
                pack_event=self.tracker.event,
                last_use=-1,
                nbytes=int(tensor.untyped_storage().nbytes()),
            )
        )
        return (index, tensor)

    def unpack(self, packed: Any) -> torch.Tensor:
        index, tensor = packed
        if index is not None:
            row = self.saved[index]
            row["last_use"] = max(row["last_use"], self.tracker.event)
            unit = row["unit"]
            if unit and self.unit_rows[unit]["bwd_start"] < 0:
                self.unit_rows[unit]["bwd_start"] = self.tracker.event
            if unit:
                self.unit_rows[unit]["bwd_end"] = self.tracker.event
                window = self.unit_rows[unit]["calls"][row["unit_call"]]
                if window[2] < 0:
                    window[2] = self.tracker.event
                window[3] = max(window[3], self.tracker.event)
        return tensor


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
) -> Profile:
    """Profile one training step (forward, ``loss_fn(output, targets)``, backward, optimizer step).

    The step runs isolated (:func:`~superneurons.memory.isolate.isolated`): on the caller's own
    module tree with its trainable parameters and buffers swapped for clones, gradients from
    ``None``, and a shadow of the innermost optimizer; afterwards the caller's parameters,
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
            did not save (for GPT-2 124M at B=8, T=1024: 1.53 GiB of logits).

    Raises:
        ConfigError: the step fails under fake tensors (data-dependent ops such as ``nonzero`` or
            ``.item()``); profile with real tensors (``fake=False``); ``optimizer`` is not a torch
            optimizer (nor wraps one).
        IsolationError: the step changed one of the caller's tensors in place outside the
            module tree (see :mod:`superneurons.memory.isolate`).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = unwrapped(model)
    unit_fqns = set(default_units(model) if units is None else units)
    names = dict(model.named_modules())
    missing = sorted(unit_fqns - set(names))
    if missing:
        raise ConfigError(
            f"units {missing} are not submodules of the model: use fqns from named_modules()"
        )
    mode = fake_mode
    already_fake = _is_fake(next(iter(model.parameters()), None))
    if fake and mode is None and not already_fake:
        mode = FakeTensorMode(allow_non_fake_inputs=False)
    if already_fake and mode is None:
        raise ConfigError("the model's parameters are fake: pass the FakeTensorMode as fake_mode=")
    if mode is not None and not already_fake:
        inputs, targets = tree_map(_to_fake(mode), (inputs, targets))
    try:
        with (
            isolated(model, optimizer, fake_mode=mode) as (model_c, opt_c),
            mode if mode is not None else contextlib.nullcontext(),
        ):
            return _run(
                model_c,
                opt_c,
                inputs,
                targets,
                loss_fn,
                unit_fqns,
                fake=mode is not None,
                keep_output=keep_output,
            )
    except (RuntimeError, NotImplementedError) as exc:
        if mode is None or isinstance(exc, IsolationError):
            raise
        raise ConfigError(
            f"the training step fails under fake tensors ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]}); data-dependent ops (nonzero, .item(), boolean "
            "masks) need real values: profile with real tensors (fake=False)"
        ) from exc


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
) -> Profile:
    tracker = LiveStorageTracker(record_timeline=False)
    rec = _Recorder(tracker, unit_fqns)
    tracker._on_op = rec.on_op  # type: ignore[assignment]
    first = next(iter(model.parameters()), None)
    on_cuda = not fake and first is not None and first.device.type == "cuda"
    if on_cuda:
        rec.timer = EventTimer()
    handles = []
    for fqn, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda _m, a, f=fqn: rec.pre(f, a)))
        handles.append(module.register_forward_hook(lambda _m, _a, out, f=fqn: rec.post(f, out)))
    handles += kv_cache_off(model)  # HF use_cache=False in training, as under a plan
    params = [*model.parameters(), *model.buffers()]
    state_tensors = _optimizer_tensors(optimizer)
    leaves = [t for t in tree_flatten((inputs, targets))[0] if isinstance(t, torch.Tensor)]
    tracker.register(params)
    rec.param_storages = {tracker.serial_of(p) for p in params} - {None}  # type: ignore[assignment]
    tracker.register(state_tensors)
    tracker.register(leaves)
    events: dict[str, int] = {}
    start_s = time.perf_counter()
    try:
        with tracker, torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
            output = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
            events["model_end"] = tracker.event
            loss = loss_fn(output, targets)
            if not keep_output:  # ``loss_fn(model(x), y).backward()``: only what autograd saved
                del output
            events["forward_end"] = tracker.event
            rec.phase = "backward"
            loss.backward()
            del loss
            output = None  # the step's output is released with the loss
            events["backward_end"] = tracker.event
            rec.phase = "step"
            if optimizer is not None:
                optimizer.step()
            events["step_end"] = tracker.event
    finally:
        for handle in handles:
            handle.remove()
    step_s = time.perf_counter() - start_s
    for fqn, row in rec.unit_rows.items():
        row["norm_state_bytes"] = running_stat_bytes(model.get_submodule(fqn))
        parent = model.get_submodule(fqn.rpartition(".")[0]) if fqn else None
        row["in_sequential"] = isinstance(parent, nn.Sequential)
    bandwidth = (0.0, 0.0)
    if rec.timer is not None:
        for fqn, seconds in rec.timer.seconds().items():
            if fqn in rec.unit_rows:
                rec.unit_rows[fqn]["time_s"] = seconds
        assert first is not None
        bandwidth = measure_copy_bandwidth(first.device)
    grads = {tracker.serial_of(p.grad) for p in model.parameters() if p.grad is not None} - {None}
    opt_state = {tracker.serial_of(t) for t in _optimizer_tensors(optimizer)} - {None}
    return Profile.from_recording(
        tracker=tracker,
        saved_rows=rec.saved,
        unit_rows=rec.unit_rows,
        # forward order (the runtime's one-ahead prefetch and the planner rely on it)
        unit_order=sorted(rec.unit_rows, key=lambda f: rec.unit_rows[f]["fwd_start"]),
        param_storages=rec.param_storages,
        grad_storages=grads,  # type: ignore[arg-type]
        opt_storages=opt_state,  # type: ignore[arg-type]
        op_of_storage=rec.op_of_storage,
        events=events,
        fake=fake,
        step_s=step_s,
        copy_bytes_per_s=bandwidth,
    )


def _optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    states = optimizer.state.values() if optimizer is not None else ()
    return [v for state in states for v in tree_flatten(state)[0] if isinstance(v, torch.Tensor)]
