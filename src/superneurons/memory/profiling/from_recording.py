"""Turning a recorded step into the :class:`Profile` the planner reads.

:func:`build_profile` takes a :class:`~superneurons.memory.profiling.recording.Recorder` with the
tracker's live intervals and builds the frozen record: the per-category timeline, every saved
storage's life, the units (a recompute's peak op by op with each op's own scratch), and the bytes
that belong to the LM head and the loss (``Profile.head_rows``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from superneurons.memory.profile_types import (
    CATEGORIES,
    Profile,
    SavedTensor,
    StorageLife,
    UnitProfile,
    head_windows,
    is_head_storage,
)
from superneurons.memory.profiling.recording import Recorder

__all__ = ["build_profile"]


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
    tracker = rec.tracker
    num_events = max(tracker.event + 1, 1)
    last = num_events - 1
    in_head = head_windows(rec.unit_rows, events, head_unit, num_events)
    rows = _category_rows(
        rec, grad_storages, opt_storages, head_unit, in_head, carried_storages or set()
    )
    saved, storages = _saved_storages(rec, head_unit, in_head, last)
    unit_order = list(unit_order)
    loose, unsaved_inputs = _unsaved_inputs(rec, unit_order, last)
    units = tuple(
        _unit_profile(rec, fqn, storages, loose.get(fqn, ()), scratch or {}) for fqn in unit_order
    )
    return Profile(
        fake=fake,
        num_events=num_events,
        forward_end_event=events.get("forward_end", last),
        backward_end_event=events.get("backward_end", last),
        model_end_event=events.get("model_end", -1),
        copy_bytes_per_s=copy_bytes_per_s,
        step_s=step_s,
        param_bytes=rows.totals["params"],
        grad_bytes=rows.totals["grads"],
        optimizer_state_bytes=rows.totals["optimizer"],
        measured_peak_bytes=int(tracker.peak_bytes),
        timeline=tuple(tuple(int(v) for v in r) for r in rows.timeline),
        saved=tuple(saved),
        storages=storages,
        units=units,
        optimizer_births=tuple(rows.opt_births),
        grad_births=tuple(rows.grad_births),
        largest_param_bytes=max(
            (tracker.nbytes[sid] for sid in rec.param_storages if sid in tracker.nbytes),
            default=0,
        ),
        head_unit=head_unit,
        head_timeline=tuple(tuple(int(v) for v in r) for r in rows.head_timeline),
        unsaved_inputs=unsaved_inputs,
        scratch=tuple(sorted((scratch or {}).items())),
        rng_state_bytes=rng_state_bytes,
        margin_bytes=margin_bytes,
        carried_output_bytes=rows.carried["all"],
        carried_head_bytes=rows.carried["head"],
    )


@dataclass(frozen=True)
class _Rows:
    """The live bytes per category event by event, and what the categories hold in all."""

    timeline: np.ndarray  # (len(CATEGORIES), E)
    head_timeline: np.ndarray  # (2, E): saved, temporaries of the LM head + loss
    totals: dict[str, int]  # params, grads, optimizer
    opt_births: list[tuple[int, int]]  # (event, bytes) of optimizer state born in the step
    grad_births: list[tuple[int, int]]
    carried: dict[str, int]  # bytes of the outputs the loop keeps: all, the head's


def _units_of(rec: Recorder) -> dict[int, set[str]]:
    """Saved storage -> the units that saved it."""
    units_of: dict[int, set[str]] = {}
    for row in rec.saved:
        units_of.setdefault(row["sid"], set()).add(row["unit"])
    return units_of


def _category_rows(
    rec: Recorder,
    grad_storages: set[int],
    opt_storages: set[int],
    head_unit: str,
    in_head: np.ndarray,
    carried_storages: set[int],
) -> _Rows:
    """Every tracked storage by category (params, optimizer, grads, saved, temporaries) over
    its live interval, and the part of them that belongs to the LM head + loss."""
    tracker = rec.tracker
    num_events = max(tracker.event + 1, 1)
    last = num_events - 1
    saved_sids = {row["sid"] for row in rec.saved}
    units_of = _units_of(rec)
    head_delta = np.zeros((2, num_events + 1), dtype=np.int64)  # (saved, temporaries)
    delta = np.zeros((len(CATEGORIES), num_events + 1), dtype=np.int64)
    totals = dict.fromkeys(("params", "grads", "optimizer"), 0)
    opt_births: list[tuple[int, int]] = []
    grad_births: list[tuple[int, int]] = []
    carried = dict.fromkeys(("all", "head"), 0)
    for sid, nbytes in tracker.nbytes.items():
        if sid in rec.param_storages:
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
        if sid in carried_storages and tracker.births[sid] >= 0:
            carried["all"] += nbytes
            carried["head"] += nbytes if head else 0
    timeline = np.cumsum(delta[:, :num_events], axis=1)
    head_timeline = np.cumsum(head_delta[:, :num_events], axis=1)
    return _Rows(timeline, head_timeline, totals, opt_births, grad_births, carried)


def _saved_storages(
    rec: Recorder, head_unit: str, in_head: np.ndarray, last: int
) -> tuple[list[SavedTensor], tuple[StorageLife, ...]]:
    """Every saved tensor, and every storage they live in with its life and the units (and
    their calls) that saved it."""
    tracker, units_of = rec.tracker, _units_of(rec)
    index_of: dict[int, int] = {}
    lives: list[dict[str, Any]] = []
    saved: list[SavedTensor] = []
    for row in rec.saved:
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
                    cached=sid in (rec.cached or ()),
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
    return saved, storages


def _unsaved_inputs(
    rec: Recorder, unit_order: list[str], last: int
) -> tuple[dict[str, list[int]], tuple[StorageLife, ...]]:
    """Inputs (positional or keyword) of each unit's first call that autograd does not save:
    a checkpoint of the unit keeps them; one storage may feed several units (HF's position
    ids). Returns unit -> those storages, and one life per storage with its units."""
    tracker = rec.tracker
    saved_sids = {row["sid"] for row in rec.saved}
    loose: dict[str, list[int]] = {}
    holders: dict[int, list[str]] = {}
    for fqn in unit_order:
        for sid in sorted(rec.unit_rows[fqn].get("first_in_sids", ())):
            if sid in saved_sids or sid in rec.param_storages or tracker.births.get(sid, -1) < 0:
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
    return loose, unsaved_inputs


def _unit_profile(
    rec: Recorder,
    fqn: str,
    storages: tuple[StorageLife, ...],
    loose: Iterable[int],
    scratch: Mapping[int, int],
) -> UnitProfile:
    """One unit's record: its windows, work, the bytes it saved and its checkpoint's."""
    u = rec.unit_rows[fqn]
    return UnitProfile(
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
        recompute_peak_bytes=_recompute_peak(u, scratch),
        unsaved_input_bytes=sum(rec.tracker.nbytes[sid] for sid in loose),
    )


def _recompute_peak(row: Mapping[str, Any], scratch: Mapping[int, int]) -> int:
    """The most a recompute of the unit holds above its start, up to its last save (early stop),
    op by op with the scratch each op allocated for itself (-1: it saved nothing).

    NOTE: op by op, not the largest scratch on top of the largest live bytes: a tiny GPT-2
    block under autocast allocates its largest scratch (0.25 MiB) in the attention's softmax,
    where it holds 2 MB less than at its peak; the sum over-predicted the step's peak with
    every block recomputed by 1.9% (benchmarks/mixed_precision.py).
    """
    if "recompute_peak" not in row:
        return -1
    stop = row["recompute_stop"]
    return max([0, *(held + scratch.get(e, 0) for e, held in row["held"] if e <= stop)])
