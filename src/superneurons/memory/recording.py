"""Recording one profiled step and turning the recording into a :class:`Profile`.

:class:`Recorder` is the mutable bookkeeping of :func:`~superneurons.memory.profile.profile_step`'s
observers: the module stack (pre/post hooks), the saved tensors (``saved_tensors_hooks``), each
unit's forward windows, FLOPs and bytes written, and where backward enters and leaves it.
:func:`build_profile` turns it, with the tracker's live intervals, into the frozen record the
planner reads: the per-category timeline, every saved storage's life, the units, and the bytes
that belong to the LM head and the loss (``Profile.head_rows``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from superneurons.memory.cost import EventTimer
from superneurons.memory.nodes import on_enter, on_leave, output_nodes
from superneurons.memory.profile_types import (
    CATEGORIES,
    Profile,
    SavedTensor,
    StorageLife,
    UnitProfile,
    head_windows,
    is_head_storage,
)
from superneurons.memory.tracker import LiveStorageTracker

__all__ = ["Recorder", "build_profile"]

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


def build_profile(
    rec: Recorder,
    *,
    unit_order: Iterable[str],
    grad_storages: set[int],
    opt_storages: set[int],
    events: Mapping[str, int],
    fake: bool,
    step_s: float,
    copy_bytes_per_s: tuple[float, float] = (0.0, 0.0),
    head_unit: str = "",
    carried_storages: set[int] | None = None,
    scratch: Mapping[int, int] | None = None,
    rng_state_bytes: int = 0,
    margin_bytes: int = 0,
) -> Profile:
    """The :class:`Profile` of one recorded step (the tracker's live intervals, the recorder's
    saved tensors and unit windows)."""
    tracker, saved_rows, unit_rows = rec.tracker, rec.saved, rec.unit_rows
    param_storages, cached_storages = rec.param_storages, rec.cached
    num_events = max(tracker.event + 1, 1)
    last = num_events - 1
    saved_sids = {row["sid"] for row in saved_rows}
    units_of: dict[int, set[str]] = {}
    for row in saved_rows:
        units_of.setdefault(row["sid"], set()).add(row["unit"])
    in_head = head_windows(unit_rows, events, head_unit, num_events)
    head_delta = np.zeros((2, num_events + 1), dtype=np.int64)  # (saved, temporaries)
    delta = np.zeros((len(CATEGORIES), num_events + 1), dtype=np.int64)
    totals = dict.fromkeys(("params", "grads", "optimizer"), 0)
    opt_births: list[tuple[int, int]] = []
    grad_births: list[tuple[int, int]] = []
    carried = dict.fromkeys(("all", "head"), 0)
    for sid, nbytes in tracker.nbytes.items():
        if sid in param_storages:
            cat = "params"
        elif sid in opt_storages:
            cat = "optimizer"
        elif sid in grad_storages:
            cat = "grads"
        elif sid in saved_sids:
            cat = "saved"
        else:
            cat = "temporaries"
        birth = max(tracker.births[sid], 0)
        death = tracker.deaths.get(sid, last) if not tracker.is_live(sid) else last
        if cat in totals:
            totals[cat] += nbytes
        if cat == "optimizer" and tracker.births[sid] >= 0:
            opt_births.append((birth, nbytes))
        if cat == "grads":
            grad_births.append((birth, nbytes))
        cat_row = CATEGORIES.index(cat)
        delta[cat_row, birth] += nbytes
        delta[cat_row, min(death, last) + 1] -= nbytes
        head = is_head_storage(cat, units_of.get(sid, set()), head_unit, bool(in_head[birth]))
        if head:
            head_row = 0 if cat == "saved" else 1
            head_delta[head_row, birth] += nbytes
            head_delta[head_row, min(death, last) + 1] -= nbytes
        if carried_storages and sid in carried_storages and tracker.births[sid] >= 0:
            carried["all"] += nbytes
            carried["head"] += nbytes if head else 0
    timeline = np.cumsum(delta[:, :num_events], axis=1)
    head_timeline = np.cumsum(head_delta[:, :num_events], axis=1)
    index_of: dict[int, int] = {}
    lives: list[dict[str, Any]] = []
    saved: list[SavedTensor] = []
    for row in saved_rows:
        sid = row["sid"]
        if sid not in index_of:
            index_of[sid] = len(lives)
            death = last if tracker.is_live(sid) else tracker.deaths.get(sid, last)
            birth = max(tracker.births.get(sid, 0), 0)
            lives.append(
                dict(
                    nbytes=row["nbytes"],
                    birth=birth,
                    head=is_head_storage("saved", units_of[sid], head_unit, bool(in_head[birth])),
                    from_caller=tracker.births.get(sid, 0) < 0,
                    cached=sid in (cached_storages or ()),
                    death=death,
                    units=[],
                    calls=[],
                )
            )
        life = lives[index_of[sid]]
        if row["unit"] not in life["units"]:
            life["units"].append(row["unit"])
            life["calls"].append(int(row.get("unit_call", 0)))
        saved.append(
            SavedTensor(
                key=row["key"],
                module=row["module"],
                op=rec.op_of_storage.get(sid, "input"),
                unit=row["unit"],
                nbytes=row["nbytes"] if row["first"] else 0,
                storage=index_of[sid],
                created_event=life["birth"],
                last_use_event=row["last_use"],
            )
        )
    storages = tuple(
        StorageLife(**{**v, "units": tuple(v["units"]), "calls": tuple(v["calls"])}) for v in lives
    )
    # inputs (positional or keyword) of each unit's first call that autograd does not save: a
    # checkpoint of the unit keeps them; one storage may feed several units (HF's position ids)
    loose: dict[str, list[int]] = {}
    holders: dict[int, list[str]] = {}
    unit_order = list(unit_order)
    for fqn in unit_order:
        for sid in sorted(unit_rows[fqn].get("first_in_sids", ())):
            if sid in saved_sids or sid in param_storages or tracker.births.get(sid, -1) < 0:
                continue
            loose.setdefault(fqn, []).append(sid)
            holders.setdefault(sid, []).append(fqn)
    unsaved_inputs = tuple(
        StorageLife(
            tracker.nbytes[sid],
            max(tracker.births[sid], 0),
            last if tracker.is_live(sid) else tracker.deaths.get(sid, last),
            tuple(fqns),
        )
        for sid, fqns in holders.items()
    )
    units = []
    for fqn in unit_order:
        u = unit_rows[fqn]
        units.append(
            UnitProfile(
                fqn=fqn,
                fwd_start_event=u["fwd_start"],
                fwd_end_event=u["fwd_end"],
                bwd_start_event=u["bwd_start"],
                flops=u["flops"],
                bytes_written=u["written"],
                fwd_time_s=u["time_s"],
                temp_peak_bytes=u["temp_peak"],
                saved_bytes=sum(s.nbytes for s in storages if fqn in s.units),
                output_bytes=int(u.get("out_bytes", 0)),
                input_bytes=sum(
                    s.nbytes
                    for s in storages
                    if fqn in s.units and not s.from_caller and s.birth < u["fwd_start"]
                ),
                bwd_end_event=int(u.get("bwd_end", -1)),
                inplace=bool(u.get("inplace", False)),
                norm_state_bytes=int(u.get("norm_state_bytes", 0)),
                in_sequential=bool(u.get("in_sequential", False)),
                calls=tuple((int(a), int(b), int(c), int(d)) for a, b, c, d in u.get("calls", ())),
                edges=tuple((int(a), int(b)) for a, b in u.get("edges", ())),
                recompute_peak_bytes=_recompute_peak(u, scratch or {}),
                unsaved_input_bytes=sum(tracker.nbytes[sid] for sid in loose.get(fqn, ())),
            )
        )
    return Profile(
        fake=fake,
        num_events=num_events,
        forward_end_event=events.get("forward_end", last),
        backward_end_event=events.get("backward_end", last),
        model_end_event=events.get("model_end", -1),
        copy_bytes_per_s=copy_bytes_per_s,
        step_s=step_s,
        param_bytes=totals["params"],
        grad_bytes=totals["grads"],
        optimizer_state_bytes=totals["optimizer"],
        measured_peak_bytes=int(tracker.peak_bytes),
        timeline=tuple(tuple(int(v) for v in r) for r in timeline),
        saved=tuple(saved),
        storages=storages,
        units=tuple(units),
        optimizer_births=tuple(opt_births),
        grad_births=tuple(grad_births),
        largest_param_bytes=max(
            (tracker.nbytes[sid] for sid in param_storages if sid in tracker.nbytes), default=0
        ),
        head_unit=head_unit,
        head_timeline=tuple(tuple(int(v) for v in r) for r in head_timeline),
        unsaved_inputs=unsaved_inputs,
        scratch=tuple(sorted((scratch or {}).items())),
        rng_state_bytes=rng_state_bytes,
        margin_bytes=margin_bytes,
        carried_output_bytes=carried["all"],
        carried_head_bytes=carried["head"],
    )


def _recompute_peak(row: Mapping[str, Any], scratch: Mapping[int, int]) -> int:
    """The most a recompute of the unit holds above its start, up to its last save (early stop),
    op by op with the scratch each op allocated for itself (-1: it saved nothing).

    NOTE: op by op, not the largest scratch on top of the largest live bytes: a tiny GPT-2
    under autocast allocates its largest scratch in the attention's softmax, 0.3 MB below the
    block's peak, and the sum over-predicted the recompute of every block by 1.9%.
    """
    if "recompute_peak" not in row:
        return -1
    stop = row["recompute_stop"]
    return max([0, *(held + scratch.get(e, 0) for e, held in row["held"] if e <= stop)])
