"""Gradients leave the device bucket by bucket: all-reduce, then the host optimizer's step.

The backward side of ``Plan.host_optimizer`` (:mod:`.host_optimizer` is the host side).
Each trainable parameter has a post-accumulate-grad hook; when the last gradient of a bucket
(the plan's ``grad_buckets``, :mod:`.buckets`) is accumulated and every earlier bucket has been
launched, the bucket is launched: its gradients are copied into one flat buffer and dropped
(a lone gradient is sent as it is), and the buffer goes through the communication hook, as
DistributedDataParallel's reducer sends its buckets. Launching the next bucket drains this one:
its reduced gradients are copied to the host, the host optimizer steps the bucket's parameters
and copies them back. So at most two buckets of gradients are on the device at any time, and
no optimizer state ever is. When backward ends (an autograd engine callback) the rest is
launched and drained, parameters that got no gradient on any rank being skipped locally and
stepped with zeros under data parallelism.

PyTorch's optimizer-overlap hooks for DDP (``torch.distributed.algorithms.ddp_comm_hooks.
optimizer_overlap_hooks``) step each bucket when its all-reduce completes, as here; they step on
the device and need DDP's reducer, which keeps a flat bucket of every gradient resident for
the whole run. Here the buckets are our own:

* **DDP.** Apply the plan *before* wrapping the model: ``apply_plan`` tells DDP to ignore all
  parameters but the smallest (``_ddp_params_and_buffers_to_ignore``, DDP's own mechanism), so
  DDP holds no gradient buckets, and :meth:`GradientBuckets.attach` takes DDP's process group,
  broadcasts the ignored parameters from rank 0 (what DDP does for the rest at construction)
  and registers a no-op communication hook on DDP. The remaining parameter goes through the
  buckets here like every other (DDP's copy of its gradient is a few zeroed bytes).
* **Compression.** The communication hook is whatever was registered on the DDP model: PyTorch's
  default all-reduce, or ``superneurons.compress.register_compression``'s (called after
  ``attach``, its ``ddp.register_comm_hook`` call is captured and runs on these buckets).

On CUDA the reduced gradients go to pinned host memory on a side stream (events, ``record_stream``)
and one host thread steps the buckets in launch order beside backward; the copy back runs on the
host optimizer's stream, which the next forward's stream waits for. On CPU every step runs in
order where the bucket drains, so results are bitwise reproducible.

**Clipping and accumulation** (a :class:`~superneurons.memory.plan.TrainingStep` that
``waits``): the buckets still leave the device as they are launched, but land in host buffers
(:class:`~superneurons.memory.offload.host_grads.HostGradients`) instead of being stepped; the
loop's ``optimizer.step()`` steps them, bucket by bucket, after its ``clip_grad_norm_``
(:meth:`GradientBuckets.clip_grad_norm_`, the global norm of the norms computed on the device
as each final sum landed). A backward that is not the last of its micro-batches (DDP's
``no_sync``: ``require_backward_grad_sync`` is false; without DDP, :attr:`GradientBuckets.sync`
says) neither all-reduces nor keeps anything on the device: its gradients are added into the
host buffers. The last one brings each bucket's sum back for the moment it is added into the
bucket (so the all-reduce and the norm see the whole sum, as DDP's reducer does after
``no_sync``) and lands the reduced sums. Without clipping or accumulation each backward's
norms are still recorded, so ``clip_grad_norm_(max_norm=inf)`` (what Trainer logs) is the
true norm; a backward that is not the last of its micro-batches is then refused.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory.offload.host_grads import HostGradients, clip_coefficient
from superneurons.memory.offload.host_optimizer import HostOptimizer, OptimizerFactory
from superneurons.memory.offload.rewrap import rebuild_in_place
from superneurons.memory.plan import TrainingStep
from superneurons.memory.tracker import untracked

__all__ = ["GradientBuckets", "ddp_ignore_names", "install_host_optimizer"]

logger = logging.getLogger("superneurons.memory")

CommHook = Callable[[Any, Any], "torch.futures.Future[torch.Tensor]"]


def ddp_ignore_names(model: nn.Module) -> list[str]:
    """Every trainable parameter's fqn but the smallest one's: what DDP should ignore so that it
    allocates no gradient buckets (it needs one parameter that requires a gradient)."""
    trainable = [(p.numel(), i, fqn) for i, (fqn, p) in enumerate(model.named_parameters())]
    trainable = [t for t in trainable if model.get_parameter(t[2]).requires_grad]
    if not trainable:
        raise ConfigError("the model has no trainable parameter")
    keep = min(trainable)[2]
    return [fqn for fqn, _ in model.named_parameters() if fqn != keep]


def install_host_optimizer(
    model: nn.Module,
    buckets: Sequence[Sequence[str]],
    factory: OptimizerFactory,
    *,
    host_device: str = "cpu",
    step: TrainingStep | None = None,
) -> GradientBuckets:
    """A :class:`HostOptimizer` over ``model``'s trainable parameters, fed by
    :class:`GradientBuckets` (for a loop that clips or accumulates as ``step`` says); DDP
    constructed from now on manages one parameter only (:func:`ddp_ignore_names`).
    ``remove()`` on the result undoes both."""
    named = [(fqn, p) for fqn, p in model.named_parameters() if p.requires_grad]
    optimizer = HostOptimizer(named, factory, host_device=host_device)
    grads = GradientBuckets(model, buckets, optimizer, host_device=host_device, step=step)
    grads._previous_ignored = getattr(model, "_ddp_params_and_buffers_to_ignore", None)
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ddp_ignore_names(model)
    )
    return grads


class _Bucket:
    """What a DDP communication hook reads of a bucket (``dist.GradBucket``'s methods)."""

    def __init__(self, index: int, last: bool, buffer: torch.Tensor, params: list[nn.Parameter]):
        self._index, self._last, self._buffer, self._params = index, last, buffer, params

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        views, offset = [], 0
        for p in self._params:
            views.append(self._buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return views


class GradientBuckets:
    """Launch each bucket of gradients once it is complete; drain it into the host optimizer.

    Args:
        model: the model whose parameters the buckets name (fqns relative to it).
        buckets: parameter fqns per bucket, in launch order; trainable parameters in none of
            them form one more bucket, launched when backward ends.
        optimizer: the host optimizer that steps them.
        host_device: ``"cpu"`` (pinned on CUDA) or ``"meta"`` (simulation).
        step: the loop's clipping and accumulation (None: neither): with either, the buckets
            land in host buffers and the loop's ``optimizer.step()`` steps them.

    Attributes:
        sync: without DDP, says whether the backward running is the last of its
            micro-batches (e.g. ``lambda: accelerator.sync_gradients``); None: every one is.
            Under DDP, DDP's own ``require_backward_grad_sync`` says (``no_sync``).
        landed: the gradients waiting for the step, and the norms of the last final ones.
    """

    def __init__(
        self,
        model: nn.Module,
        buckets: Sequence[Sequence[str]],
        optimizer: HostOptimizer,
        *,
        host_device: str = "cpu",
        step: TrainingStep | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.host_device = host_device
        self.training_step = step or TrainingStep()
        self.waits = self.training_step.waits
        self.landed = HostGradients()
        self.sync: Callable[[], bool] | None = None
        self._final = True  # this backward is the last of its micro-batches
        self._ddp: Any = None
        params = {fqn: p for fqn, p in model.named_parameters() if p.requires_grad}
        unknown = [f for b in buckets for f in b if f not in params]
        if unknown:
            raise ConfigError(
                f"the plan's gradient buckets name {unknown[:3]}, which are not trainable "
                f"parameters of {type(model).__name__}: re-plan this model"
            )
        named = [list(b) for b in buckets if b]
        rest = [f for f in params if all(f not in b for b in named)]
        self.buckets: list[list[str]] = [*named, rest] if rest else named
        self._params = params
        self._bucket_of = {f: i for i, b in enumerate(self.buckets) for f in b}
        self._ready: list[set[str]] = [set() for _ in self.buckets]
        self._next = 0  # the next bucket to launch
        # (the flat buffer's names, its reduction or None, those landing, host gradients)
        self._inflight: tuple[list[str], Any, list[str], dict[str, torch.Tensor]] | None = None
        self._callback_queued = False
        self.group: Any = None
        self.world_size = 1
        self._ddp_managed: list[nn.Parameter] = []
        self.hook: CommHook | None = None
        self.hook_state: Any = None
        self._device = next(iter(params.values())).device
        self._cuda = self._device.type == "cuda"
        self._d2h: Any = torch.cuda.Stream(self._device) if self._cuda else None
        # CUDA: one host thread steps the buckets in launch order while backward goes on
        self._worker = ThreadPoolExecutor(1, "superneurons-host-step") if self._cuda else None
        self._steps: list[Future[None]] = []
        self.handles = [
            p.register_post_accumulate_grad_hook(lambda p, f=fqn: self._on_grad(f))
            for fqn, p in params.items()
        ]
        self.launched_bytes = 0  # gradient bytes sent to the host (counters for stats)
        # parameters whose gradient is made on the host and handed over (the LM head's weight
        # read in vocabulary slices: memory.offload.slices), with the CUDA event after which
        # it is whole (None: whole when it arrives)
        self._on_host: dict[str, Callable[[], Any]] = {}
        self._rebuild_ddp: Callable[[], None] | None = None  # undoes attach(rebuild=True)
        self._previous_ignored: Any = None  # DDP's ignore list before install_host_optimizer

    def grads_on_host(self, fqn: str, ready: Callable[[], Any]) -> Callable[[torch.Tensor], None]:
        """Parameter ``fqn``'s gradient is made on the host (whole after the CUDA event
        ``ready()`` returns, or at once where that is None): returns what takes each backward's
        gradient (a host tensor) in place of autograd; its bucket steps it from there, with no
        copy and no device byte."""
        if fqn not in self._params:
            raise ConfigError(f"{fqn!r} is not a trainable parameter of the planned model")
        self._on_host[fqn] = ready
        return functools.partial(self._receive, fqn)

    def _receive(self, fqn: str, grad: torch.Tensor) -> None:
        """A host gradient arrived: it becomes the parameter's ``.grad`` (added to one there:
        autograd's ``grad += new``), as its post-accumulate-grad hook would see it."""
        param = self._params[fqn]
        if param.grad is None:
            param.grad = grad
        else:
            with untracked(), torch.no_grad():
                param.grad.add_(grad)
        self._on_grad(fqn)

    # --- data parallel ---------------------------------------------------------------------
    def attach(self, ddp: nn.parallel.DistributedDataParallel, *, rebuild: bool = False) -> None:
        """Reduce over ``ddp``'s process group with its communication hook (see module doc).
        ``rebuild``: ``ddp`` was constructed before the plan (a Trainer's, an Accelerator's):
        it is rebuilt in place to hold no gradient buckets (:mod:`.rewrap`), and rebuilt as it
        was by :meth:`remove` (every rank calls both)."""
        if ddp.module is not self.model:
            raise ConfigError("attach the DDP model that wraps the planned model itself")
        ignored = set(getattr(ddp, "parameters_to_ignore", ()))
        managed = [f for f in self._params if f not in ignored]
        if len(managed) > 1 and rebuild:
            self._rebuild_ddp = rebuild_in_place(ddp)
            ignored = set(getattr(ddp, "parameters_to_ignore", ()))
            managed = [f for f in self._params if f not in ignored]
        if len(managed) > 1:
            raise ConfigError(
                "DistributedDataParallel was constructed before the plan was applied: it holds "
                f"a gradient bucket for {len(managed)} parameters. Apply the plan first, then "
                "wrap the model: handle = apply_plan(model, plan, ...); "
                "ddp = DistributedDataParallel(model); handle.attach(ddp)"
            )
        self.group = ddp.process_group
        self.world_size = dist.get_world_size(self.group)
        self._ddp = ddp
        self._ddp_managed = [self._params[f] for f in managed]
        hooks = getattr(ddp, "_comm_hooks", [])
        if hooks:  # registered before attach: DDP also runs it on its one parameter (zeros)
            self.hook, self.hook_state = hooks[-1]
            logger.warning("a comm hook was registered before attach(); it runs here too")
        else:
            ddp.register_comm_hook(None, _noop_hook)
            ddp.register_comm_hook = self._capture  # type: ignore[method-assign]
        with torch.no_grad():
            for fqn, param in self.model.named_parameters():
                if fqn in ignored:
                    dist.broadcast(param.data, src=_global_rank(self.group, 0), group=self.group)
        self.optimizer.refresh()

    def _capture(self, state: Any, hook: CommHook) -> None:
        self.hook, self.hook_state = hook, state

    # --- backward ---------------------------------------------------------------------------
    def _on_grad(self, fqn: str) -> None:
        if not self._callback_queued:
            self._final = self._last_micro_batch()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True
        self._ready[self._bucket_of[fqn]].add(fqn)
        while self._next < len(self.buckets) and len(self._ready[self._next]) == len(
            self.buckets[self._next]
        ):
            self._launch(self._next)

    def _last_micro_batch(self) -> bool:
        """Whether the backward starting is the last of its micro-batches (module docstring);
        refused where the plan steps in backward."""
        if self._ddp is not None:
            final = bool(self._ddp.require_backward_grad_sync)
        else:
            final = True if self.sync is None else bool(self.sync())
        if not final and not self.waits:
            raise ConfigError(
                "the loop accumulates gradients over micro-batches (no_sync, or sync_gradients "
                "is false), but the plan steps the optimizer on the host after every backward: "
                "plan with TrainingStep(accumulation_steps=...) (prepare_superneurons and the "
                "HF callback pass the loop's gradient_accumulation_steps)"
            )
        if not self.landed.buffers:
            self.landed.norms.clear()  # of the previous step
        return final

    def _launch(self, index: int) -> None:
        """Flatten bucket ``index``'s gradients (with the sums of earlier micro-batches, on the
        last one), drop them, start its reduction; then drain the bucket launched before it.
        Gradients already on the host (:meth:`grads_on_host`) are taken as they are."""
        names = [f for f in self.buckets[index] if f not in self._on_host]
        on_host = self._take_host_grads(index)
        params = [self._params[f] for f in names]
        grads = [p.grad for p in params]
        sums = self.landed.pending(names) if self.waits and self._final else {}
        landing = [f for f, g in zip(names, grads, strict=True) if g is not None or f in sums]
        self._next = index + 1
        reduce = self.world_size > 1 and self._final
        if not landing and not reduce:
            self._drain()
            if on_host:
                self._inflight = (names, None, [], on_host)
            return
        flat = self._flatten(params, grads)
        if sums:
            self._add_sums(flat, names, sums)
        for p in params:
            p.grad = None
        del grads
        if reduce:
            bucket = _Bucket(index, index == len(self.buckets) - 1, flat, params)
            hook = self.hook or _default_hook
            future = hook(self.hook_state if self.hook else self.group, bucket)
            landing = list(names)  # under data parallelism every parameter is reduced
        else:  # one process, or a micro-batch under no_sync: nothing to reduce
            future = torch.futures.Future()
            future.set_result(flat)
        del flat
        self._drain()
        self._inflight = (names, future, landing, on_host)

    def _take_host_grads(self, index: int) -> dict[str, torch.Tensor]:
        """The host gradients of bucket ``index`` (their ``.grad`` dropped)."""
        taken = {}
        for fqn in (f for f in self.buckets[index] if f in self._on_host):
            param = self._params[fqn]
            if param.grad is not None:
                taken[fqn], param.grad = param.grad, None
        if taken and self.world_size > 1:
            raise ConfigError(
                f"{sorted(taken)[:3]} have their gradients on the host (a streamed LM head in "
                "vocabulary slices), which runs on one device: plan without weight streaming "
                "under data parallelism"
            )
        return taken

    def _flatten(self, params: list[nn.Parameter], grads: list[Any]) -> torch.Tensor:
        """The bucket's gradients in one flat buffer, zeros where a parameter has none (a lone
        contiguous gradient is sent as it is)."""
        if len(params) == 1 and grads[0] is not None and grads[0].is_contiguous():
            return grads[0].view(-1)
        like = next((g for g in grads if g is not None), None)
        dtype = like.dtype if like is not None else params[0].dtype
        flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            piece = flat[offset : offset + p.numel()]
            if g is None:
                piece.zero_()
            else:
                piece.copy_(g.reshape(-1))
            offset += p.numel()
        return flat

    def _add_sums(self, flat: torch.Tensor, names: list[str], sums: dict[str, Any]) -> None:
        """Add the host sums of the earlier micro-batches into ``flat`` on the device
        (``flat + sums`` is ``sums + flat`` bit for bit: autograd's ``grad += new``)."""
        with untracked():
            host = torch.zeros(flat.shape, dtype=flat.dtype, pin_memory=self._cuda)
            offset = 0
            for fqn in names:
                numel = self._params[fqn].numel()
                if fqn in sums:
                    host[offset : offset + numel].copy_(sums[fqn].reshape(-1))
                offset += numel
        staged = torch.empty_like(flat)  # the planner's staged bucket (buckets.bucket_timeline)
        staged.copy_(host, non_blocking=self._cuda)
        flat.add_(staged)
        del staged

    def _drain(self) -> None:
        """Wait for the bucket in flight, copy its reduced gradients to the host, and step them
        (or land them in the host buffers, where the step waits)."""
        if self._inflight is None:
            return
        flat_names, future, names, on_host = self._inflight
        self._inflight = None
        grads: dict[str, torch.Tensor] = {}
        copied = [self._on_host[f]() for f in on_host]
        if future is not None:
            grads, event = self._drain_flat(flat_names, future, names)
            copied.append(event)
        for grad in on_host.values():
            self.launched_bytes += grad.numel() * grad.element_size()
        work = functools.partial(self._work, grads, on_host, final=self._final)
        if self._worker is None:
            work()  # CPU: here, in order (bitwise reproducible)
        else:  # CUDA: the host works beside backward once the copies have landed
            self._steps.append(self._worker.submit(self._when_copied, copied, work))

    def _drain_flat(
        self, flat_names: list[str], future: Any, names: list[str]
    ) -> tuple[dict[str, torch.Tensor], Any]:
        """The reduced flat buffer's gradients of ``names`` copied to the host (and the CUDA
        event of that copy), their norms recorded on the device."""
        reduced = future.wait()
        reduced = reduced[0] if isinstance(reduced, list) else reduced  # (numel,)
        views, offset = {}, 0
        for fqn in flat_names:
            numel = self._params[fqn].numel()
            if fqn in names:
                views[fqn] = reduced[offset : offset + numel].view_as(self._params[fqn])
            offset += numel
        if self._final:  # the gradients are whole: their norms, on the device
            self._record_norms(views, reduced.dtype)
        host, copied = self._to_host(reduced)
        del reduced, future, views
        grads, offset = {}, 0
        with untracked():  # views of host memory: on a CPU-only build no tracker may count them
            for fqn in flat_names:
                numel = self._params[fqn].numel()
                if fqn in names:
                    grads[fqn] = host[offset : offset + numel].view_as(self._params[fqn])
                offset += numel
        self.launched_bytes += host.numel() * host.element_size()
        return grads, copied

    def _work(
        self, grads: dict[str, torch.Tensor], on_host: dict[str, torch.Tensor], *, final: bool
    ) -> None:
        """The host's part of one bucket, once its gradients are there: the gradients made on
        the host get the sums of earlier micro-batches (on the last one) and their norms here;
        then the bucket is stepped, or landed where the step waits."""
        if on_host:
            with untracked(), torch.no_grad():
                if self.waits and final:
                    for fqn, sums in self.landed.pending(on_host).items():
                        on_host[fqn].add_(sums)
                if final:
                    self._record_norms(on_host, next(iter(on_host.values())).dtype)
        grads = {**grads, **on_host}
        if self.waits:
            self.landed.land(grads, final=final)
        else:
            self.optimizer.step(grads)

    def _record_norms(self, views: dict[str, torch.Tensor], dtype: Any) -> None:
        """Each final gradient's norm, as ``clip_grad_norm_`` computes it (a 0-dim tensor per
        parameter on the device: not counted)."""
        if not views or self.host_device == "meta":
            return
        norm_type = self.training_step.norm_type
        with untracked(), torch.no_grad():
            norms = torch._foreach_norm(list(views.values()), norm_type)
        self.landed.record_norms(dict(zip(views, norms, strict=True)), dtype, norm_type)

    def _when_copied(self, copied: list[Any], work: Callable[[], None]) -> None:
        with torch.cuda.device(self._device):
            for event in (e for e in copied if e is not None):
                event.synchronize()  # this worker thread waits, not backward's
            work()

    def _to_host(self, reduced: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The reduced gradients in host memory, and the CUDA event of their copy (None
        elsewhere: the copy is done when this returns)."""
        if self.host_device == "meta":
            return torch.empty(reduced.shape, dtype=reduced.dtype, device="meta"), None
        with untracked():
            host = torch.empty(reduced.shape, dtype=reduced.dtype, pin_memory=self._cuda)
            if not self._cuda:
                return host.copy_(reduced), None
            self._d2h.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._d2h):
                host.copy_(reduced, non_blocking=True)
                reduced.record_stream(self._d2h)  # not reused before the copy has read it
                return host, self._d2h.record_event()

    def _finish(self) -> None:
        """End of backward: launch what is left in order (missing gradients as zeros under data
        parallelism, skipped locally), drain, and order the next forward after the copies."""
        try:
            while self._next < len(self.buckets):
                self._launch(self._next)
            self._drain()
            for done in self._steps:
                done.result()  # a failed host step raises here, in backward
            self.optimizer.wait()
        finally:
            self._next = 0
            self._ready = [set() for _ in self.buckets]
            self._callback_queued = False
            self._steps = []
        if self._ddp_managed:  # after DDP's own end-of-backward callback, queued before this one
            torch.autograd.Variable._execution_engine.queue_callback(self._drop_ddp_gradients)

    def _drop_ddp_gradients(self) -> None:
        """DDP copies its (already sent) gradient back into its one parameter when backward
        ends; dropped, so nothing accumulates into it next step."""
        for param in self._ddp_managed:
            param.grad = None

    # --- the loop's step (where the step waits) -----------------------------------------------
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, order: Sequence[str] | None = None
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the gradients waiting on the host (the total
        norm of their norms in ``order``, parameter fqns; default: the model's order), which
        it scales in place; returns the total norm. Where the plan steps in backward the
        gradients were stepped already: the norm of the last backward is returned for
        ``max_norm=inf`` (what Trainer logs) and a finite ``max_norm`` is refused."""
        order = list(order) if order is not None else list(self._params)
        total = self.landed.norm(order, float(norm_type))
        if not self.waits:
            if math.isfinite(max_norm):
                raise ConfigError(
                    "the plan steps the optimizer on the host during backward, before a global "
                    "gradient norm exists: plan with TrainingStep(max_grad_norm=...) "
                    "(prepare_superneurons(max_grad_norm=...); the HF callback passes "
                    "max_grad_norm itself)"
                )
            return total
        if self.landed:
            self.landed.scale_(clip_coefficient(total, max_norm))
        return total

    def step_landed(self) -> None:
        """Step the gradients waiting on the host, bucket by bucket in launch order, and copy
        the parameters back (the loop's ``optimizer.step()`` where the step waits)."""
        for names in self.buckets:
            grads = self.landed.take(names)
            if grads:
                self.optimizer.step(grads)
        self.landed.clear()
        self.optimizer.wait()

    def discard(self) -> None:
        """Drop the gradients waiting on the host (the loop's ``zero_grad()``)."""
        self.landed.clear()

    def remove(self) -> None:
        """Drop the hooks; give DDP back the parameters it was told to ignore (for a DDP
        constructed afterwards)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self.model.__dict__.pop("_ddp_params_and_buffers_to_ignore", None)
        for param in self.model.parameters():
            param.__dict__.pop("_ddp_ignored", None)
        if self._previous_ignored is not None:
            nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                self.model, self._previous_ignored
            )
            self._previous_ignored = None
        if self._rebuild_ddp is not None:  # DDP as it was: reducing every parameter again
            rebuild, self._rebuild_ddp = self._rebuild_ddp, None
            rebuild()


def _noop_hook(_state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP's hook for the one parameter it still manages: its gradient went through our buckets
    already (the plan's hook dropped it), so there is nothing to reduce."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


# NOTE: DDP's register_comm_hook compares the annotations with the objects themselves, and this
# module's annotations are strings (``from __future__ import annotations``)
_noop_hook.__annotations__ = {
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _default_hook(group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's default DDP reduction: divide by the world size, all-reduce (sum)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook(group, bucket)


def _global_rank(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank
