"""Weights in the host pool: a unit's parameters live on the host and visit the device only
around the unit's forward and its backward (``UnitDecision.weights == "host"``).

SuperNeurons' Unified Tensor Pool (Wang et al., PPoPP'18 §3.2) moves any tensor whose next use is
far away; a block's weights are used once in forward and once in backward, seconds apart.
DeepSpeed ZeRO-Infinity and FSDP2's ``CPUOffloadPolicy`` keep parameters on the host too; here
the plan decides which units stream (:mod:`superneurons.memory.planner.weights` predicts the
same windows this module opens):

* **Between uses a streamed parameter *is* its host copy** (``param.data`` points at it: pinned
  on CUDA; on a CPU-only build a separate allocation made outside every tracker, so the device
  count sees only the copies). Reading ``model.lm_head.weight`` mid-step gives its current
  values (on CUDA a host tensor: using it in a device op raises PyTorch's device error); a write
  into it lands in the host copy, and the host optimizer notices it by the version counter.
* **Forward**: entering a streamed unit's forward fetches its weights (waiting on the event of
  the prefetch, if one was issued) and prefetches the next streamed unit's on a side stream;
  leaving it points the parameters back at their host copies and drops the device copies.
* **Saved tensors** that are a streamed parameter or a view of one (``F.linear`` saves
  ``weight.t()``) are packed as a reference (``saved_tensors_hooks``; the activation pool asks
  :meth:`WeightStream.pack` first) and rebuilt on unpack from the device copy of the backward
  window, so no saved tensor pins a forward copy.
* **Backward**: when backward enters a streamed call's outputs (autograd-node pre-hooks,
  ``memory.nodes``) the windows of later calls close, the call's weights are fetched (or were
  prefetched) and the previous call's (forward order) are prefetched; the end of backward
  closes everything. A unit whose backward reads none of its weights (an ``nn.Embedding``
  that is not recomputed: ``forward_only``) opens no backward window and is not prefetched
  for it; entering its backward still closes the windows of later calls.
* A parameter held by several streamed units (tied embeddings) has one host copy and at most
  one device copy, open while any of its units' windows is. A module called twice opens its
  window twice.
* **Trainable** streamed parameters need the host optimizer (``plan.host_optimizer``): their
  gradient leaves for the host bucket as any other's, the host step writes the host copy
  (:meth:`~superneurons.memory.offload.host_optimizer.HostOptimizer.retarget`), and the next
  fetch carries it. **Frozen** ones (an adapter's base) stream with no gradient.
* **4-bit weights** (bitsandbytes' ``Params4bit``, QLoRA's nf4 base, Dettmers et al. 2023)
  stream with their quantization state: the packed ``uint8`` data is the parameter, and each
  tensor its ``quant_state`` holds (absmax, ``uint8`` under double quantisation with the nested
  ``state2``'s fp32 absmax and code, the offset, the nf4 code:
  :func:`superneurons.memory.param_state.held_tensors`) has a host copy and a device copy of
  its own, the ``QuantState``'s attribute pointed at one or the other with the weight's window.
  ``MatMul4Bit`` keeps the packed weight for its backward as a ``ctx`` attribute
  (``ctx.tensors``, bitsandbytes 0.50 ``autograd/_functions.py``), which no saved-tensor hook
  sees: a forward hook on the layer finds that node, and the view it holds is pointed at the
  weight's host copy when a window closes and at the device copy when backward's opens, so it
  dequantizes the device copy of the backward window and pins no forward copy; ``ctx.state``
  is the ``QuantState`` itself, whose attributes follow the windows. LLM.int8() weights
  (``Int8Params``, whose layer keeps the int8 values and scales in a ``MatmulLtState`` of its
  own) are refused, as is a 4-bit weight bitsandbytes has repacked for CPU inference
  (``packing_format_for_cpu``: eval mode without gradients on an AVX512-BF16 host).

CUDA: copies run on a side stream from pinned memory (``non_blocking``), ordered by events and
``record_stream``; no ``torch.cuda.synchronize()``. CPU: the same code, copies synchronous.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory.nodes import on_enter, output_nodes
from superneurons.memory.offload.slices import StreamedRows
from superneurons.memory.param_state import held_tensors
from superneurons.memory.profile_types import unit_params
from superneurons.memory.tracker import untracked

__all__ = ["WeightRef", "WeightStream", "WeightStreamStats"]

logger = logging.getLogger("superneurons.memory")


@dataclass(frozen=True)
class WeightStreamStats:
    """What the weight stream did (bytes are storage bytes)."""

    host_bytes: int  # pinned host bytes of the streamed parameters
    device_bytes: int  # bytes of device copies alive now
    h2d_bytes: int  # bytes copied host -> device so far
    fetches: int  # device copies made (prefetched or on demand)
    prefetch_hits: int  # windows opened on a prefetched copy
    demand_fetches: int  # windows opened (or saved tensors unpacked) without one
    written_back: int  # device copies written inside a window, copied back to the host


class _Weight:
    """One streamed tensor (a parameter's data, or a tensor a 4-bit parameter holds beside
    it): its host copy, its device copy while some window needs it."""

    def __init__(
        self,
        fqn: str,
        param: nn.Parameter,
        host: torch.Tensor,
        owners: tuple[tuple[Any, str], ...] | None = None,
    ) -> None:
        self.fqn, self.param, self.host = fqn, param, host
        # what points at the copy in use: ``param.data``, or a QuantState's attribute(s)
        self.owners = owners if owners is not None else ((param, "data"),)
        self.device: torch.Tensor | None = None
        self.event: Any = None  # CUDA event of the copy that made ``device``
        self.users = 0  # open windows
        self.version = 0  # the tensor's version when its window opened
        # bitsandbytes' MatMul4Bit nodes holding a view of the copy (module doc): (node, geometry)
        self.bound: list[tuple[weakref.ref[Any], tuple[Any, Any, int]]] = []

    def point(self, tensor: torch.Tensor) -> None:
        """Point the parameter (or the QuantState's attribute) and the MatMul4Bit nodes
        holding it at ``tensor`` (the host copy or the device copy)."""
        for owner, attr in self.owners:
            setattr(owner, attr, tensor)
        alive = []
        with untracked():  # views: no storage made
            for node_ref, geometry in self.bound:
                node = node_ref()
                if node is not None:
                    node.tensors = (node.tensors[0], tensor.as_strided(*geometry))
                    alive.append((node_ref, geometry))
        self.bound = alive

    def current_version(self) -> int:
        owner, attr = self.owners[0]
        return int(owner._version if attr == "data" else getattr(owner, attr)._version)


class WeightRef:
    """A saved tensor that is (a view of) a streamed parameter: rebuilt on unpack."""

    __slots__ = ("weight", "geometry")

    def __init__(self, weight: _Weight, geometry: tuple[Any, Any, int]) -> None:
        self.weight = weight
        self.geometry = geometry  # (size, stride, storage offset)


class WeightStream:
    """The host copies and device windows of the streamed units' parameters (module doc).

    Args:
        model: the planned model (unit fqns are relative to it).
        units: the streamed units' fqns, in forward order.
        all_units: every unit of the plan: a parameter streams when every module holding it is
            inside a streamed unit.
        device: where the units compute.
        sliced: parameters read in slices of rows by their unit's forward and backward (the LM
            head's weight under the vocabulary-sliced loss): hosted as the others, never
            fetched whole; :meth:`rows_of` serves their slices (:mod:`.slices`).
        forward_only: streamed units whose backward reads none of their weights (an embedding
            that is not recomputed: ``profile_types.weightless_backward``): no backward window
            (a saved weight one unpacks all the same is fetched on demand).
    """

    def __init__(
        self,
        model: nn.Module,
        units: Sequence[str],
        *,
        all_units: Sequence[str],
        device: torch.device,
        sliced: Sequence[nn.Parameter] = (),
        forward_only: Collection[str] = (),
    ) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._stream: Any = torch.cuda.Stream(device) if self._cuda else None
        self.units = list(units)
        self.modules = [model.get_submodule(f) for f in self.units]
        self.weights, self._of_unit = _streamed(model, self.units, all_units)
        self._reads = [f not in forward_only for f in self.units]  # backward opens a window
        self._by_storage: dict[int, _Weight] = {}  # device copy's storage -> its weight
        self._calls: list[int] = []  # unit index of each forward call since the last backward
        self._needs_backward: list[bool] = []
        self._open_backward: set[int] = set()  # calls whose backward window is open
        self._finish_queued = False
        self._counters = dict.fromkeys(
            ("h2d_bytes", "fetches", "prefetch_hits", "demand_fetches", "written_back"), 0
        )
        self._sliced: dict[int, StreamedRows] = {}
        for param in sliced:  # before any hook: a refusal leaves no trace on the model
            self._slice(param)
        self._hooks = [
            module.register_forward_hook(lambda _m, _a, out, w=weight: self._bind(w, out))
            for weight, module in _four_bit_layers(model, self.weights)
        ]

    def _slice(self, param: nn.Parameter) -> None:
        """Serve ``param`` in slices of rows instead of whole in its unit's windows."""
        weight = next(
            (w for w in self.weights if w.param is param and w.owners[0][1] == "data"), None
        )
        if weight is None:
            raise ConfigError(
                "the plan streams the LM head's weight in vocabulary slices, but the head's "
                "unit does not stream it (a module outside the streamed units holds it, e.g. an "
                "input embedding tied to it): re-plan this model"
            )
        held = [i for i, of_unit in enumerate(self._of_unit) if weight in of_unit]
        if len(held) != 1:
            raise ConfigError(
                f"{weight.fqn!r} is tied to another streamed unit's weight (an input embedding "
                "shared with the LM head): a tied head cannot stream in vocabulary slices, "
                "since the other unit reads it whole; plan without vocab_rows, or untie it"
            )
        self._of_unit[held[0]].remove(weight)
        self._sliced[id(param)] = StreamedRows(
            weight.host, self.device, stream=self._stream, counters=self._counters
        )

    def rows_of(self, param: nn.Parameter) -> StreamedRows | None:
        """The slices of ``param`` when it streams in slices (``sliced``), else None."""
        return self._sliced.get(id(param))

    # --- set-up / undo ------------------------------------------------------------------------
    def move_to_host(self) -> None:
        """Point every streamed parameter at a host copy of its values (pinned on CUDA)."""
        with untracked(), torch.no_grad():
            for weight in self.weights:
                weight.point(weight.host)
        logger.info(
            "weights of %d units stream from the host: %d bytes",
            len(self.units),
            self.host_bytes(),
        )

    def restore(self) -> None:
        """Put every streamed parameter back on the device (``PlanHandle.remove``)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        with torch.no_grad():
            for weight in self.weights:
                weight.bound.clear()
                weight.point(weight.host.to(self.device, copy=True))
                weight.device, weight.users = None, 0
        self._by_storage.clear()

    def host_bytes(self) -> int:
        return sum(w.host.untyped_storage().nbytes() for w in self.weights)

    def host_buffers(self) -> list[torch.Tensor]:
        """The host copies (subtract from a live-storage count: they are not device bytes)."""
        return [w.host for w in self.weights]

    def stats(self) -> WeightStreamStats:
        device_bytes = sum(
            w.device.untyped_storage().nbytes() for w in self.weights if w.device is not None
        )
        return WeightStreamStats(self.host_bytes(), device_bytes, **self._counters)

    # --- copies -------------------------------------------------------------------------------
    def _fetch(self, weight: _Weight) -> None:
        """Start the copy of ``weight`` to the device (side stream on CUDA), if not there."""
        if weight.device is not None:
            return
        with _on(self._stream):
            copy = torch.empty_like(weight.host, device=self.device)
            copy.copy_(weight.host, non_blocking=self._cuda)
            weight.event = self._stream.record_event() if self._stream is not None else None
        weight.device = copy
        self._by_storage[_key(copy)] = weight
        self._counters["h2d_bytes"] += copy.untyped_storage().nbytes()
        self._counters["fetches"] += 1

    def _ready(self, weight: _Weight) -> torch.Tensor:
        """The device copy, usable on the current stream."""
        if weight.device is None:
            self._counters["demand_fetches"] += 1
            self._fetch(weight)
        else:
            self._counters["prefetch_hits"] += 1
        copy = weight.device
        assert copy is not None
        if self._cuda and weight.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(weight.event)
            copy.record_stream(current)  # the allocator must not reuse it before we are done
        return copy

    def _release(self, weight: _Weight) -> None:
        copy = weight.device
        if copy is None:
            return
        if weight.current_version() != weight.version:  # written inside the window: keep it
            with untracked(), torch.no_grad():
                weight.host.copy_(copy)
            self._counters["written_back"] += 1
        _check_not_repacked(weight)
        weight.point(weight.host)
        self._by_storage.pop(_key(copy), None)
        weight.device = weight.event = None

    def _open(self, index: int) -> None:
        for weight in self._of_unit[index]:
            if weight.users == 0:
                weight.point(self._ready(weight))
                weight.version = weight.current_version()
            weight.users += 1

    def _close(self, index: int) -> None:
        for weight in self._of_unit[index]:
            weight.users -= 1
            if weight.users == 0:
                self._release(weight)

    def _prefetch(self, index: int) -> None:
        for weight in self._of_unit[index] if 0 <= index < len(self.units) else ():
            self._fetch(weight)

    def _bind(self, weight: _Weight, out: Any) -> None:
        """After a 4-bit layer's forward: the MatMul4Bit node holding a view of ``weight``'s
        device copy as ``ctx.tensors`` follows its windows from now on (module doc)."""
        node = _matmul_4bit_node(out)
        packed = None if node is None else node.tensors[1]
        if weight.device is None or not isinstance(packed, torch.Tensor):
            return
        if _key(packed) != _key(weight.device):
            return
        geometry = (packed.size(), packed.stride(), int(packed.storage_offset()))
        weight.bound = [b for b in weight.bound if b[0]() is not None]
        weight.bound.append((weakref.ref(node), geometry))

    # --- forward ------------------------------------------------------------------------------
    def forward_of(self, index: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` of streamed unit ``index`` run inside its window."""

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self._open(index)
            self._prefetch(index + 1)  # one streamed unit ahead
            try:
                with self.saving():
                    out = forward(*args, **kwargs)
            finally:
                self._close(index)
            if torch.is_grad_enabled():
                nodes = output_nodes(out)
                call = len(self._calls)
                self._calls.append(index)
                self._needs_backward.append(bool(nodes))
                on_enter(nodes, lambda: self._backward_entered(call))
            return out

        return wrapped

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Saved tensors that are streamed weights go as references (module doc); the
        activation pool, when it runs inside, asks :meth:`pack` itself."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack_or_keep, self.unpack):
            yield

    def pack(self, tensor: torch.Tensor) -> WeightRef | None:
        """A reference for a saved (view of a) streamed parameter's device copy, else None."""
        if not self._by_storage or not isinstance(tensor, torch.Tensor):
            return None
        weight = self._by_storage.get(_key(tensor))
        if weight is None:
            return None
        return WeightRef(weight, (tensor.size(), tensor.stride(), int(tensor.storage_offset())))

    def _pack_or_keep(self, tensor: torch.Tensor) -> Any:
        ref = self.pack(tensor)
        return tensor if ref is None else ref

    def unpack(self, packed: Any) -> Any:
        """Rebuild a :class:`WeightRef` from the device copy of its window (fetched on demand
        outside one); anything else as it is."""
        if not isinstance(packed, WeightRef):
            return packed
        weight = packed.weight
        copy = self._ready(weight) if weight.users else self._demand(weight)
        size, stride, offset = packed.geometry
        return copy.as_strided(size, stride, offset)

    def _demand(self, weight: _Weight) -> torch.Tensor:
        """A device copy for an unpack outside every window (not kept)."""
        self._counters["demand_fetches"] += 1
        copy = weight.host.to(self.device, copy=True)
        self._counters["h2d_bytes"] += copy.untyped_storage().nbytes()
        return copy

    # --- backward -----------------------------------------------------------------------------
    def _backward_entered(self, call: int) -> None:
        if not self._finish_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            self._finish_queued = True
        for later in sorted(c for c in self._open_backward if c > call):
            self._open_backward.discard(later)
            self._close(self._calls[later])
        if call not in self._open_backward and self._reads[self._calls[call]]:
            self._open_backward.add(call)
            self._open(self._calls[call])
        previous = next(
            (
                c
                for c in range(call - 1, -1, -1)
                if self._needs_backward[c] and self._reads[self._calls[c]]
            ),
            None,
        )  # the call before it in forward order that backward will enter and read weights in
        if previous is not None:
            self._prefetch(self._calls[previous])

    def _backward_done(self) -> None:
        for call in sorted(self._open_backward, reverse=True):
            self._close(self._calls[call])
        self._open_backward.clear()
        for weight in self.weights:  # a prefetch no window used
            if weight.users == 0:
                self._release(weight)
        self._calls.clear()
        self._needs_backward.clear()
        self._finish_queued = False

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Counters only: the weights are the model's (``model.state_dict()`` reads the host
        copies)."""
        return {"counters": dict(self._counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._counters.update({k: int(v) for k, v in state["counters"].items()})


def _streamed(
    model: nn.Module, units: Sequence[str], all_units: Sequence[str]
) -> tuple[list[_Weight], list[list[_Weight]]]:
    """The tensors that stream (parameters whose every module is inside a streamed unit, with
    what 4-bit ones hold beside their data), with host copies made, and each streamed unit's
    list of them."""
    streamed = set(units)
    params = dict(model.named_parameters())
    held = {h.fqn: h for h in held_tensors(model)}
    weights: list[_Weight] = []
    of_unit: list[list[_Weight]] = [[] for _ in units]
    for info in unit_params(model, all_units):
        if not info.units or not all(u in streamed for u in info.units):
            continue
        if info.fqn in params:
            param = params[info.fqn]
            _check_streamable(info.fqn, param, streamable=info.streamable)
            weight = _Weight(info.fqn, param, _host_copy(param.detach()))
        else:  # a tensor a 4-bit weight holds (module doc): checked with its parameter
            state = held[info.fqn]
            weight = _Weight(
                info.fqn, params[state.params[0]], _host_copy(state.tensor), state.owners
            )
        weights.append(weight)
        for unit in info.units:
            of_unit[units.index(unit)].append(weight)
    return weights, of_unit


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor``'s values (pinned when it is on CUDA), made outside every
    tracker."""
    with untracked(), torch.no_grad():
        host = torch.empty(
            tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda
        )
        host.copy_(tensor)
    return host


def _check_streamable(fqn: str, param: nn.Parameter, *, streamable: bool) -> None:
    if not streamable:
        raise ConfigError(
            f"parameter {fqn!r} is a bitsandbytes LLM.int8() weight (its layer keeps the int8 "
            "values and scales in a state of its own): its unit's weights cannot stream; keep "
            "them on the device (weights='device')"
        )
    if getattr(getattr(param, "quant_state", None), "packing_format_for_cpu", False):
        raise ConfigError(
            f"parameter {fqn!r} is a 4-bit weight bitsandbytes repacked for CPU inference: "
            "streaming serves training; keep its unit's weights on the device"
        )
    if type(param.data) is not torch.Tensor or param.layout != torch.strided:
        raise ConfigError(
            f"parameter {fqn!r} is a {type(param.data).__name__} (a tensor subclass or a "
            "sparse layout): its unit's weights cannot stream; keep them on the device"
        )


def _check_not_repacked(weight: _Weight) -> None:
    """bitsandbytes repacks a 4-bit weight for CPU inference inside its forward (eval mode, no
    gradient, an AVX512-BF16 host: ``Linear4bit.forward``), flagging its ``QuantState``:
    pointing the parameter back at its host copy would pair the old layout with that flag."""
    state = getattr(weight.param, "quant_state", None)
    if weight.owners[0][1] == "data" and getattr(state, "packing_format_for_cpu", False):
        raise ConfigError(
            f"bitsandbytes repacked the streamed 4-bit weight {weight.fqn!r} for CPU inference "
            "(eval mode without gradients): streaming serves training; remove the plan "
            "(handle.remove()) before inference"
        )


def _four_bit_layers(
    model: nn.Module, weights: Sequence[_Weight]
) -> list[tuple[_Weight, nn.Module]]:
    """The streamed 4-bit weights (parameters with a ``quant_state``) and the layers holding
    them, whose forward hooks find bitsandbytes' MatMul4Bit nodes."""
    four_bit = {
        id(w.param): w
        for w in weights
        if w.owners[0][1] == "data" and getattr(w.param, "quant_state", None) is not None
    }
    return [
        (four_bit[id(param)], module)
        for module in model.modules()
        for param in module.parameters(recurse=False)
        if id(param) in four_bit
    ]


def _matmul_4bit_node(out: Any) -> Any:
    """The ``MatMul4Bit`` node behind a ``Linear4bit``'s output (its product cast back to the
    input's dtype: at most one node above it), or None (no gradient: ``gemm_4bit`` ran alone)."""
    node = out.grad_fn if isinstance(out, torch.Tensor) else None
    for _ in range(2):
        if node is None:
            return None
        if type(node).__name__ == "MatMul4BitBackward":
            return node
        node = node.next_functions[0][0] if node.next_functions else None
    return None


def _key(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)


def _on(stream: Any) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
