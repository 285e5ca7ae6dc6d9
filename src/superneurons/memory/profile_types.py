"""The records a profiled step produces: :class:`Profile`, :class:`SavedTensor`,
:class:`UnitProfile`.

Events are the aten ops of the step in execution order (forward, backward, optimizer step). A
storage is live on ``[birth, death]`` (inclusive, sampled right after each op, as the tracker
samples its peak); storages alive before the step have birth 0, those alive after it death
``num_events - 1``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import nn

from superneurons.memory.param_state import held_tensors, int8_parameter
from superneurons.memory.plan import HeadChunking, SeqChunking

__all__ = [
    "CATEGORIES",
    "GRANULARITIES",
    "Profile",
    "SavedTensor",
    "StorageLife",
    "UnitParam",
    "UnitProfile",
    "default_units",
    "head_unit",
    "head_windows",
    "is_head_storage",
    "layer_units",
    "unit_params",
    "weightless_backward",
]

# The unit sets a profile can be made with: blocks (``default_units``), every layer
# (``layer_units``), or blocks with the largest split into layers (``bounds.split_largest``).
GRANULARITIES: tuple[str, ...] = ("block", "layer", "split")

CATEGORIES: tuple[str, ...] = ("params", "grads", "optimizer", "saved", "temporaries")
# NOTE: what a real cpu profile reserves for allocations below the dispatcher outside any op's
# profiler range (scalars made into tensors, generator states): a tiny GPT-2 with dropout under
# a recompute plan held 24 B no range explained (the c10 allocator's view,
# tests/test_memory_budget_matrix.py); 4 KiB states the margin with room
ALLOCATOR_MARGIN_BYTES = 4096


def default_units(model: nn.Module) -> list[str]:
    """The blocks of the model, plus every other part of the step's path to them.

    Blocks: the outermost non-leaf children of ``nn.Sequential``/``nn.ModuleList`` containers,
    descending through containers of blocks (stages): the zoo ResNets' residual blocks, GPT's
    transformer blocks. Then, so that a plan covers the whole step (the stem, the final norm, the
    head), every child of the root or of an ancestor of a block that neither is nor contains a
    block becomes a unit too (e.g. a ResNet's ``conv1``, ``bn1``, ``relu``, ``maxpool``, ``fc``;
    GPT's ``transformer.wte``, ``transformer.ln_f``, ``lm_head``). A model with no blocks (e.g.
    a flat ``nn.Sequential`` of layers) gets its leaf layers as units. Units come in
    ``named_modules`` order.
    """
    containers = (nn.Sequential, nn.ModuleList)
    found: list[str] = []
    for fqn, module in model.named_modules():
        if not isinstance(module, containers):
            continue
        for name, child in module.named_children():
            child_fqn = f"{fqn}.{name}" if fqn else name
            grandchildren = list(child.children())
            if not grandchildren:
                continue  # a leaf layer: units are blocks
            if isinstance(child, containers) and all(any(g.children()) for g in grandchildren):
                continue  # a stage of blocks: its blocks are the units
            if not any(child_fqn.startswith(f + ".") for f in found):
                found.append(child_fqn)
    if not found:
        if isinstance(model, nn.Sequential):
            return [name for name, _ in model.named_children()]
        return []
    ancestors = {""} | {f.rsplit(".", i)[0] for f in found for i in range(1, f.count(".") + 1)}
    blocks = set(found)
    for fqn, module in model.named_modules():
        if fqn not in ancestors:
            continue
        for name, _ in module.named_children():
            child_fqn = f"{fqn}.{name}" if fqn else name
            if child_fqn not in ancestors and child_fqn not in blocks:
                found.append(child_fqn)
    position = {fqn: i for i, (fqn, _) in enumerate(model.named_modules())}
    return sorted(found, key=position.__getitem__)


def head_unit(model: nn.Module, units: Iterable[str]) -> str:
    """The unit that is or holds the model's output embedding (an LM head), "" if none.

    The output embedding is what a ``transformers`` model's ``get_output_embeddings()`` returns
    (on the model or a submodule: a step wrapper holds the model as a child), else a module
    named ``lm_head`` (the zoo GPT's).
    """
    names = {id(m): fqn for fqn, m in model.named_modules()}
    target = ""
    for module in model.modules():
        getter = getattr(module, "get_output_embeddings", None)
        embedding = getter() if callable(getter) else None
        if isinstance(embedding, nn.Module) and id(embedding) in names:
            target = names[id(embedding)]
            break
    if not target:
        target = next((f for f in names.values() if f.rpartition(".")[2] == "lm_head"), "")
    if not target:
        return ""
    holding = [u for u in units if u and (target == u or target.startswith(u + "."))]
    return max(holding, key=len, default="")  # the innermost unit holding it


def layer_units(model: nn.Module) -> list[str]:
    """Every leaf module (layer) as a unit: SuperNeurons' own granularity (Wang et al.,
    PPoPP'18 §3: the peak falls toward one *layer's* working set). Many more units than
    :func:`default_units` (ResNet-50: 126 instead of 22), so planning takes longer."""
    return [fqn for fqn, m in model.named_modules() if fqn and not any(m.children())]


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
    # storage stays on the device however its units are planned (memory.offload.pool)
    pool_keeps: bool = False
    head: bool = False  # the LM head's or the loss's (``Profile.head_unit``; ``breakdown``)
    # a parameter cast autocast's cache holds until the autocast block exits (the end of the
    # forward and loss): a plan cannot free it before
    cached: bool = False

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
            early stop ends), with the scratch each op allocated for itself (``Profile.scratch``)
            at that op; -1: not recorded.
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
    norm_state_bytes: int = 0  # running statistics a recompute snapshots (memory.runtime.recompute)
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
class UnitParam:
    """One parameter (each storage once), or a tensor parameters hold beside their data, and
    the units whose modules hold it.

    A unit's weights can stream through the host pool (``Plan`` version 4, ``weights="host"``)
    only as whole parameters: a parameter streams when every module holding it lies inside a
    streamed unit (tied embeddings stream when both the embedding's unit and the head's do); a
    4-bit weight's quantization state streams with it.

    Attributes:
        fqn: its name in ``model.named_parameters()``, or for a held tensor the path below its
            parameter (:func:`superneurons.memory.param_state.held_tensors`).
        nbytes: its storage bytes.
        trainable: it takes a gradient (its optimizer runs on the host when it streams).
        units: the units whose modules hold it (a held tensor: its parameters'); ``""`` among
            them when a module outside every unit holds it too (then it never streams).
        streamable: it can stream at all: not an LLM.int8() weight nor its scales
            (:func:`superneurons.memory.param_state.int8_parameter`).
        rows: its size along dimension 0 (a slice of ``r`` rows holds ``r / rows`` of its
            bytes: the LM head's weight in vocabulary slices); 0 for a scalar or a held tensor.
    """

    fqn: str
    nbytes: int
    trainable: bool
    units: tuple[str, ...]
    streamable: bool = True
    rows: int = 0


def weightless_backward(module: nn.Module) -> bool:
    """``module``'s backward reads none of its weights: a plain ``nn.Embedding`` (its backward,
    ``embedding_dense_backward``, scatters the output's gradient by the saved indices into a
    weight-sized gradient; ``max_norm`` renormalises the weight in forward, so it is left
    out, as is any subclass with a forward of its own). One definition for the profile
    (:attr:`Profile.weightless_backward`) and the runtime (:mod:`superneurons.memory.offload.
    weights`): a streamed unit that is one opens no backward window."""
    return (
        isinstance(module, nn.Embedding)
        and type(module).forward is nn.Embedding.forward
        and module.max_norm is None
    )


def unit_params(model: nn.Module, units: Iterable[str]) -> tuple[UnitParam, ...]:
    """Every parameter of ``model`` with the units (of ``units``) that hold it, in
    ``named_parameters`` order, then the tensors parameters hold beside their data (a 4-bit
    weight's quantization state), each with the units of the parameters holding it: one
    definition for the profile (what the planner may stream) and the runtime (what it
    streams)."""
    unit_list = sorted(set(units), key=len, reverse=True)  # the innermost unit first
    holders: dict[int, list[str]] = {}
    int8: set[int] = set()
    for fqn, module in model.named_modules():
        owner = next((u for u in unit_list if u and (fqn == u or fqn.startswith(u + "."))), "")
        for param in module.parameters(recurse=False):
            found = holders.setdefault(id(param), [])
            if owner not in found:
                found.append(owner)
            if int8_parameter(param, module):
                int8.add(id(param))
    records = {
        fqn: UnitParam(
            fqn,
            _nbytes(p),
            p.requires_grad,
            tuple(holders.get(id(p), [""])),
            id(p) not in int8,
            int(p.shape[0]) if p.dim() else 0,
        )
        for fqn, p in model.named_parameters()
    }
    held = []
    for tensor in held_tensors(model):
        owners = [records[name] for name in tensor.params]
        units_of = tuple(dict.fromkeys(u for owner in owners for u in owner.units))
        streamable = all(owner.streamable for owner in owners)
        held.append(UnitParam(tensor.fqn, _nbytes(tensor.tensor), False, units_of, streamable))
    return (*records.values(), *held)


def _nbytes(tensor: Any) -> int:
    return int(tensor.untyped_storage().nbytes()) if tensor.device.type != "meta" else tensor.nbytes


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
    # split over the sequence, LoRA layers whose adapters keep their input at the base's
    # precision (a plan made from this profile carries them: memory.plan)
    head: HeadChunking | None = None
    seq_chunks: tuple[SeqChunking, ...] = ()
    adapter_inputs: tuple[str, ...] = ()
    # elements of the parameters that train (the host optimizer's fp32 masters), and the bytes of
    # those that take no gradient (frozen base weights of adapters, quantized weights and their
    # quantization state): resident, never stepped nor copied
    param_numel: int = 0
    frozen_bytes: int = 0
    # the event at which each entry of ``grad_births`` became its parameter's ``.grad`` (its
    # post-accumulate hook); later than the birth when the storage was made earlier (a head
    # computing its gradient in the forward); () when not recorded: the birth
    grad_ready: tuple[int, ...] = ()
    # the unit holding the model's output embedding (an LM head; "": none) and, per event, the
    # eager live bytes of (saved, temporaries) that belong to it or to the loss: what
    # ``breakdown["head_loss"]`` counts (see :meth:`head_rows`)
    head_unit: str = ""
    head_timeline: tuple[tuple[int, ...], ...] = ()
    # bytes of the model's output the loop carries into the next step (``carry_output``): live
    # in steady state from event 0 to ``model_end_event`` too; of which head + loss bytes
    carried_output_bytes: int = 0
    carried_head_bytes: int = 0
    # each storage some unit's first call took as input (positional or keyword) that autograd
    # does not save, with the units that took it: what checkpoints of those units keep
    unsaved_inputs: tuple[StorageLife, ...] = ()
    # device bytes no tensor holds (real cpu profiles; none on fake ones, and on CUDA, where
    # ``memory.profiling.workspace`` handles workspaces): (event, bytes) of the scratch an op
    # allocated for itself (counted as temporaries at that event), and the cpu generator state a
    # checkpoint stashes per recomputed call
    scratch: tuple[tuple[int, int], ...] = ()
    rng_state_bytes: int = 0
    # a stated margin, counted at every event, for the few bytes allocated below the dispatcher
    # outside any op's range (``ALLOCATOR_MARGIN_BYTES`` on real cpu profiles, else 0)
    margin_bytes: int = 0
    # every parameter with the units holding it (:func:`unit_params`; () when not recorded:
    # no unit's weights can stream)
    unit_params: tuple[UnitParam, ...] = ()
    # the units whose backward reads none of their weights (:func:`weightless_backward`): a
    # streamed one is fetched for its forward only, unless it is recomputed
    weightless_backward: tuple[str, ...] = ()

    @property
    def scratch_bytes(self) -> int:
        """The largest scratch one op of the step allocated for itself (0: none recorded)."""
        return max((nbytes for _, nbytes in self.scratch), default=0)

    @property
    def saved_bytes(self) -> int:
        return sum(s.nbytes for s in self.storages)

    def timeline_array(self, *, steady_state: bool = True) -> np.ndarray:
        """``(len(CATEGORIES), num_events)`` int64 array of live bytes (a fresh copy).

        With ``steady_state`` the optimizer state the first step creates is counted from event 0,
        as it is resident from the second step on.
        """
        return (self._steady_table if steady_state else self._table).copy()

    # NOTE: the planner evaluates hundreds of candidate plans per profile; converting the
    # timeline tuples to arrays each time was half of its time on a 28,000-event step
    @functools.cached_property
    def _table(self) -> np.ndarray:
        return np.array(self.timeline, dtype=np.int64).reshape(len(CATEGORIES), -1)

    @functools.cached_property
    def _steady_table(self) -> np.ndarray:
        table = self._table.copy()
        row = CATEGORIES.index("optimizer")
        for birth, nbytes in self.optimizer_births:
            table[row, : max(birth, 0)] += nbytes
        for event, nbytes in self.scratch:  # what the op allocated for itself, inside it
            table[CATEGORIES.index("temporaries"), event] += nbytes
        table[CATEGORIES.index("temporaries")] += self.margin_bytes
        # the previous step's output, until the model's forward returns the new one
        table[CATEGORIES.index("temporaries"), : self.model_end_event + 1] += (
            self.carried_output_bytes
        )
        return table

    @functools.cached_property
    def gradients(self) -> tuple[tuple[int, int, int], ...]:
        """``(birth, ready, nbytes)`` of each gradient, in ``grad_births`` order: born at
        ``birth``, accumulated into its parameter's ``.grad`` at ``ready`` (its birth where
        ``grad_ready`` was not recorded). Computed once per profile: the planner's searches and
        predictions read it hundreds of times."""
        ready = self.grad_ready or tuple(b for b, _ in self.grad_births)
        return tuple((b, max(b, r), n) for (b, n), r in zip(self.grad_births, ready, strict=True))

    def head_rows(self) -> np.ndarray:
        """``(2, num_events)`` int64 array: the eager live bytes (steady state) of saved tensors
        and of temporaries that belong to the LM head unit (:attr:`head_unit`) or to the loss.

        A storage belongs to them when the head unit saved it, or when it was born inside the
        head unit's forward, in the loss's forward (after the last unit's forward, up to
        :attr:`forward_end_event`) or in backward before it left the head unit (the loss's
        backward, the logits' gradient): the ``head_loss`` row of a plan's ``breakdown``.
        """
        return self._head_table.copy()

    @functools.cached_property
    def _head_table(self) -> np.ndarray:
        if not self.head_timeline:
            return np.zeros((2, self.num_events), dtype=np.int64)
        table = np.array(self.head_timeline, dtype=np.int64).reshape(2, -1)
        table[1, : self.model_end_event + 1] += self.carried_head_bytes
        return table

    def predicted_peak_bytes(self, *, steady_state: bool = True) -> int:
        """Peak of the liveness timeline (eager PyTorch, nothing planned)."""
        return int(self.timeline_array(steady_state=steady_state).sum(axis=0).max(initial=0))

    def peak_by_category(self, *, steady_state: bool = True) -> dict[str, int]:
        table = self.timeline_array(steady_state=steady_state)
        at = int(table.sum(axis=0).argmax())
        return {name: int(table[i, at]) for i, name in enumerate(CATEGORIES)}


def head_windows(
    unit_rows: Mapping[str, Mapping[str, Any]],
    events: Mapping[str, int],
    head_unit: str,
    num_events: int,
) -> np.ndarray:
    """Per event: inside the head unit's forward, the loss's forward, or backward before it
    left the head unit (before the first unit's backward when there is no head unit)."""
    mask = np.zeros(num_events + 1, dtype=bool)
    last = num_events - 1
    forward_end = events.get("forward_end", last)
    backward_end = events.get("backward_end", last)
    calls = [c for row in unit_rows.values() for c in row.get("calls", ())]
    last_unit_end = max((int(c[1]) for c in calls), default=-1)
    mask[last_unit_end + 1 : forward_end + 1] = True  # the loss's forward
    head = unit_rows.get(head_unit) if head_unit else None
    if head is not None:
        for start, end, bwd_start, bwd_end in head.get("calls", ()):
            mask[start : end + 1] = True
            bwd_end = max(bwd_start, bwd_end)
            if bwd_end >= 0:  # the loss's backward, then the head's own
                mask[forward_end + 1 : min(bwd_end, backward_end) + 1] = True
    else:
        entered = [int(c[2]) for c in calls if int(c[2]) > forward_end]
        mask[forward_end + 1 : min(entered, default=backward_end + 1)] = True
    return mask


def is_head_storage(category: str, units: set[str], head_unit: str, born_in_window: bool) -> bool:
    """A storage of the head + loss row: saved by the head unit, or born in its windows and
    saved by no other unit (a temporary, or a tensor the loss saved)."""
    if category not in ("saved", "temporaries"):
        return False
    if head_unit and head_unit in units:
        return True
    return born_in_window and not (units - {""})
