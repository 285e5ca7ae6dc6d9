"""Recording one profiled step.

:class:`Recorder` is the mutable bookkeeping of
:func:`~superneurons.memory.profiling.step.profile_step`'s observers: the module stack (pre/post
hooks) and the autocast state each module began under, the saved tensors (``saved_tensors_hooks``),
each unit's forward windows, FLOPs, bytes written and bytes held op by op, and where backward enters
and leaves it. :func:`~superneurons.memory.profiling.from_recording.build_profile` turns it into a
:class:`Profile`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from superneurons.memory.nodes import on_enter, on_leave, output_nodes
from superneurons.memory.planner.cost import EventTimer
from superneurons.memory.tracker import LiveStorageTracker

__all__ = ["Recorder"]

_DEVICES = ("cpu", "cuda")  # where a step's autocast can be on


class Recorder:
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
        self.cached: set[int] = set()  # parameter casts autocast's cache holds (storage serials)
        # per entry of ``stack``: the device types autocast was on for when the module's forward
        # began (read in the hook: inside an op autocast's own kernel has switched it off)
        self.autocast_of: list[frozenset[str]] = []
        self.timer: EventTimer | None = None  # CUDA events per unit forward (real CUDA runs)

    # module hooks --------------------------------------------------------------------------
    def pre(self, fqn: str, args: Any = ()) -> None:
        call = self.calls.get(fqn, 0)
        self.calls[fqn] = call + 1
        self.stack.append((fqn, call))
        self.autocast_of.append(frozenset(d for d in _DEVICES if torch.is_autocast_enabled(d)))
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
                    held=[],
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
            self.autocast_of.pop()
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

    def _autocast_cast(self, args: Any, out: Any) -> bool:
        """A cast autocast caches until its block exits: of a leaf that requires grad (a
        parameter) to autocast's dtype, while autocast is on (``cached_cast`` in ATen's
        ``autocast_mode.h``), in the innermost module running."""
        x = args[0] if args else None
        if not (isinstance(x, torch.Tensor) and x.is_leaf and x.requires_grad):
            return False
        device = x.device.type
        on = bool(self.autocast_of) and device in self.autocast_of[-1]
        return (
            on
            and isinstance(out, torch.Tensor)
            and out.dtype == torch.get_autocast_dtype(device)
            and torch.is_autocast_cache_enabled()
        )

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
                    if name == "_to_copy" and self._autocast_cast(args, out):
                        self.cached.add(sid)
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
        held = self.tracker.live_bytes - row["live_at_start"]
        row["temp_peak"] = max(row["temp_peak"], held)
        row["held"].append((event, held))  # with each op's scratch: its recompute's peak

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
            self.unit_rows[unit]["recompute_stop"] = self.tracker.event
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
