"""The records a profiled step produces: :class:`Profile`, :class:`SavedTensor`, :class:`UnitProfile`.

Events are the aten ops of the step in execution order (forward, backward, optimizer step). A
storage is live on ``[birth, death]`` (inclusive, sampled right after each op, as the tracker
samples its peak); storages alive before the step have birth 0, those alive after it death
``num_events - 1``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from superneurons.memory.plan import HeadChunking, SeqChunking
from superneurons.memory.units import GRANULARITIES, default_units, layer_units

__all__ = [
    "CATEGORIES",
    "GRANULARITIES",
    "Profile",
    "SavedTensor",
    "StorageLife",
    "UnitProfile",
    "default_units",
    "layer_units",
]

CATEGORIES: tuple[str, ...] = ("params", "grads", "optimizer", "saved", "temporaries")


@dataclass(frozen=True)
class SavedTensor:
    """One tensor autograd saved in forward (parameters excluded: always resident).

    Attributes:
        key: ``"<fqn>#<call>:<ordinal>"``: innermost module running, its call index (a module
            called twice has calls 0 and 1), the order of the save within that call.
        module: fqn of the innermost module running when it was saved (``""``: top level).
        op: the aten op that created its storage.
        unit: fqn of the innermost unit running (``""``: none).
        nbytes: its storage bytes, or 0 when an earlier key already counted the storage.
        storage: index into :attr:`Profile.storages`.
        created_event / last_use_event: birth of its storage; the last unpack in backward.
    """

    key: str
    module: str
    op: str
    unit: str
    nbytes: int
    storage: int
    created_event: int
    last_use_event: int


@dataclass(frozen=True)
class StorageLife:
    """A storage some saved tensor refers to: size, live interval and the units that saved it.

    ``calls[i]`` is the call of ``units[i]`` that first saved it (a unit called several times
    in one forward saves different storages in each call; see :attr:`UnitProfile.calls`).
    """

    nbytes: int
    birth: int
    death: int
    units: tuple[str, ...]
    calls: tuple[int, ...] = ()
    from_caller: bool = False  # alive before the step (an input): no plan frees it
    # one of its saves is a view the tensor pool does not move (broadcast, stride 0): the
    # storage stays on the device however its units are planned (memory.pool)
    pool_keeps: bool = False

    def call_of(self, unit: str) -> int:
        """The call of ``unit`` that saved this storage (0 when not recorded)."""
        return self.calls[self.units.index(unit)] if self.calls else 0


@dataclass(frozen=True)
class UnitProfile:
    """A unit's forward window, cost and saved bytes.

    Attributes:
        fqn: the module's fully qualified name.
        fwd_start_event / fwd_end_event: first and last op of its (first) forward call.
        bwd_start_event: first unpack of one of its saved tensors in backward (-1: none).
        flops: forward FLOPs (``torch.utils.flop_counter`` formulas; matmul and conv dominate).
        bytes_written: bytes of all op outputs of its forward (memory-bound recompute cost).
        fwd_time_s: measured wall time of its forward calls (meaningless under fake tensors).
        temp_peak_bytes: most bytes its forward held above the live bytes at its start.
        recompute_peak_bytes: the same, up to its last saved tensor (where a recompute with
            early stop ends; -1: not recorded).
        saved_bytes: storage-deduped bytes of the saved tensors packed in it.
        output_bytes: bytes of its forward's output storages (a recompute with early stop,
            as non-reentrant checkpoint does, never re-creates them).
        input_bytes: storage bytes of its saved tensors born before its forward (what a
            checkpoint of the unit saves, and ``recompute+offload`` sends to the host).
        bwd_end_event: last unpack of one of its saved tensors in backward (-1: none).
        inplace: its forward returned a tensor sharing storage with an input (an in-place
            layer such as ``ReLU(inplace=True)``): it cannot be recomputed from its input.
        norm_state_bytes: BatchNorm running statistics a recompute of it snapshots.
        unsaved_input_bytes: bytes of its inputs that eager autograd does not save (e.g. a
            dropout's input), made during the step: a checkpoint of the unit would keep them.
        calls: ``(fwd_start, fwd_end, bwd_start, bwd_end)`` events of each forward call (the
            fields above span all of them). A module called several times in one forward (a
            ResNet bottleneck's one ``ReLU``, three calls) saves, releases and gets back each
            call's tensors in that call's own windows, as the runtime's pool groups do.
        edges: per call, ``(enter, leave)``: the last event before backward entered its
            output nodes and before it left them (:mod:`superneurons.memory.nodes`; -1: never),
            where the runtime prefetches pool groups.
    """

    fqn: str
    fwd_start_event: int
    fwd_end_event: int
    bwd_start_event: int
    flops: int
    bytes_written: int
    fwd_time_s: float
    temp_peak_bytes: int
    saved_bytes: int
    output_bytes: int = 0
    input_bytes: int = 0
    bwd_end_event: int = -1
    inplace: bool = False
    norm_state_bytes: int = 0  # running statistics a recompute snapshots (memory.recompute)
    unsaved_input_bytes: int = 0
    in_sequential: bool = False  # a child of an ``nn.Sequential`` (segments need one)
    calls: tuple[tuple[int, int, int, int], ...] = ()
    edges: tuple[tuple[int, int], ...] = ()
    recompute_peak_bytes: int = -1

    def window(self, call: int = 0) -> tuple[int, int, int, int]:
        """``(fwd_start, fwd_end, bwd_start, bwd_end)`` of forward call ``call`` (the whole
        span when calls were not recorded)."""
        if self.calls:
            return self.calls[call]
        return (self.fwd_start_event, self.fwd_end_event, self.bwd_start_event, self.bwd_end_event)


@dataclass(frozen=True)
class Profile:
    """Everything the planner needs about one training step.

    ``timeline[i][e]`` is the live bytes of category ``CATEGORIES[i]`` right after event ``e``,
    from the measured live intervals of every storage. ``measured_peak_bytes`` is the tracker's
    own running peak of the same step.
    """

    fake: bool
    num_events: int
    forward_end_event: int
    backward_end_event: int
    step_s: float
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    measured_peak_bytes: int
    timeline: tuple[tuple[int, ...], ...]
    saved: tuple[SavedTensor, ...]
    storages: tuple[StorageLife, ...]
    units: tuple[UnitProfile, ...]
    optimizer_births: tuple[tuple[int, int], ...]  # (birth event, bytes) of state made by step
    largest_param_bytes: int = 0
    grad_births: tuple[tuple[int, int], ...] = ()  # (birth event, bytes) of each gradient
    model_end_event: int = -1  # last op of the model's forward (the loss follows)
    # pinned (device -> host, host -> device) bytes/s measured with the profile (real CUDA
    # profiles; 0: not measured, use a device preset)
    copy_bytes_per_s: tuple[float, float] = (0.0, 0.0)
    # the fqn of the parameter each entry of ``grad_births`` belongs to ("" when not recorded)
    grad_params: tuple[str, ...] = ()
    # how the step was profiled below the largest layer: the LM head + loss in chunks, sub-layers
    # split over the sequence (a plan made from this profile carries them: memory.plan)
    head: HeadChunking | None = None
    seq_chunks: tuple[SeqChunking, ...] = ()
    param_numel: int = 0  # elements of the parameters (the host optimizer's fp32 masters)
    # the event at which each entry of ``grad_births`` became its parameter's ``.grad`` (its
    # post-accumulate hook); later than the birth when the storage was made earlier (a head
    # computing its gradient in the forward); () when not recorded: the birth
    grad_ready: tuple[int, ...] = ()

    def gradient_events(self) -> list[tuple[int, int, int]]:
        """``(birth, ready, nbytes)`` of each gradient (``ready >= birth``)."""
        ready = self.grad_ready or tuple(b for b, _ in self.grad_births)
        return [(b, max(b, r), n) for (b, n), r in zip(self.grad_births, ready, strict=True)]

    @property
    def saved_bytes(self) -> int:
        return sum(s.nbytes for s in self.storages)

    def timeline_array(self, *, steady_state: bool = True) -> np.ndarray:
        """``(len(CATEGORIES), num_events)`` int64 array of live bytes.

        With ``steady_state`` the optimizer state the first step creates is counted from event 0,
        as it is resident from the second step on.
        """
        table = np.array(self.timeline, dtype=np.int64).reshape(len(CATEGORIES), -1)
        if steady_state and self.optimizer_births:
            row = CATEGORIES.index("optimizer")
            for birth, nbytes in self.optimizer_births:
                table[row, : max(birth, 0)] += nbytes
        return table

    def predicted_peak_bytes(self, *, steady_state: bool = True) -> int:
        """Peak of the liveness timeline (eager PyTorch, nothing planned)."""
        return int(self.timeline_array(steady_state=steady_state).sum(axis=0).max(initial=0))

    def peak_by_category(self, *, steady_state: bool = True) -> dict[str, int]:
        table = self.timeline_array(steady_state=steady_state)
        at = int(table.sum(axis=0).argmax())
        return {name: int(table[i, at]) for i, name in enumerate(CATEGORIES)}

    @classmethod
    def from_recording(
        cls,
        *,
        tracker: Any,
        saved_rows: list[dict[str, Any]],
        unit_rows: Mapping[str, Mapping[str, Any]],
        unit_order: Iterable[str],
        param_storages: set[int],
        grad_storages: set[int],
        opt_storages: set[int],
        op_of_storage: Mapping[int, str],
        events: Mapping[str, int],
        fake: bool,
        step_s: float,
        copy_bytes_per_s: tuple[float, float] = (0.0, 0.0),
        grad_names: Mapping[int, str] | None = None,
        head: HeadChunking | None = None,
        seq_chunks: tuple[SeqChunking, ...] = (),
        param_numel: int = 0,
        grad_ready: Mapping[str, int] | None = None,
    ) -> Profile:
        num_events = max(tracker.event + 1, 1)
        last = num_events - 1
        saved_sids = {row["sid"] for row in saved_rows}
        delta = np.zeros((len(CATEGORIES), num_events + 1), dtype=np.int64)
        totals = dict.fromkeys(("params", "grads", "optimizer"), 0)
        opt_births: list[tuple[int, int]] = []
        grad_births: list[tuple[int, int]] = []
        grad_params: list[str] = []
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
                grad_params.append((grad_names or {}).get(sid, ""))
            cat_row = CATEGORIES.index(cat)
            delta[cat_row, birth] += nbytes
            delta[cat_row, min(death, last) + 1] -= nbytes
        timeline = np.cumsum(delta[:, :num_events], axis=1)
        index_of: dict[int, int] = {}
        lives: list[dict[str, Any]] = []
        saved: list[SavedTensor] = []
        for row in saved_rows:
            sid = row["sid"]
            if sid not in index_of:
                index_of[sid] = len(lives)
                death = last if tracker.is_live(sid) else tracker.deaths.get(sid, last)
                lives.append(
                    dict(
                        nbytes=row["nbytes"],
                        birth=max(tracker.births.get(sid, 0), 0),
                        from_caller=tracker.births.get(sid, 0) < 0,
                        death=death,
                        units=[],
                        calls=[],
                        pool_keeps=False,
                    )
                )
            life = lives[index_of[sid]]
            life["pool_keeps"] = life["pool_keeps"] or bool(row.get("pool_keeps", False))
            if row["unit"] not in life["units"]:
                life["units"].append(row["unit"])
                life["calls"].append(int(row.get("unit_call", 0)))
            saved.append(
                SavedTensor(
                    key=row["key"],
                    module=row["module"],
                    op=op_of_storage.get(sid, "input"),
                    unit=row["unit"],
                    nbytes=row["nbytes"] if row["first"] else 0,
                    storage=index_of[sid],
                    created_event=life["birth"],
                    last_use_event=row["last_use"],
                )
            )
        storages = tuple(
            StorageLife(
                v["nbytes"],
                v["birth"],
                v["death"],
                tuple(v["units"]),
                tuple(v["calls"]),
                from_caller=v["from_caller"],
                pool_keeps=v["pool_keeps"],
            )
            for v in lives
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
                    calls=tuple(
                        (int(a), int(b), int(c), int(d)) for a, b, c, d in u.get("calls", ())
                    ),
                    edges=tuple((int(a), int(b)) for a, b in u.get("edges", ())),
                    recompute_peak_bytes=int(u.get("recompute_peak", -1)),
                    unsaved_input_bytes=sum(
                        tracker.nbytes[sid]
                        for sid in u.get("first_in_sids", ())
                        if sid not in saved_sids
                        and sid not in param_storages
                        and tracker.births.get(sid, -1) >= 0
                    ),
                )
            )
        return cls(
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
            grad_params=tuple(grad_params),
            grad_ready=tuple(
                (grad_ready or {}).get(name, birth)
                for name, (birth, _) in zip(grad_params, grad_births, strict=True)
            ),
            head=head,
            seq_chunks=tuple(seq_chunks),
            param_numel=param_numel,
            largest_param_bytes=max(
                (tracker.nbytes[sid] for sid in param_storages if sid in tracker.nbytes), default=0
            ),
        )
