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

Gradient accumulation over several backward passes is not supported (each backward steps).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory.offload.host_optimizer import HostOptimizer, OptimizerFactory
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
) -> GradientBuckets:
    """A :class:`HostOptimizer` over ``model``'s trainable parameters, fed by
    :class:`GradientBuckets`; DDP constructed from now on manages one parameter only
    (:func:`ddp_ignore_names`). ``remove()`` on the result undoes both."""
    named = [(fqn, p) for fqn, p in model.named_parameters() if p.requires_grad]
    optimizer = HostOptimizer(named, factory, host_device=host_device)
    grads = GradientBuckets(model, buckets, optimizer, host_device=host_device)
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
    """

    def __init__(
        self,
        model: nn.Module,
        buckets: Sequence[Sequence[str]],
        optimizer: HostOptimizer,
        *,
        host_device: str = "cpu",
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.host_device = host_device
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
        self._inflight: tuple[int, Any, list[str]] | None = None
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
        self._previous_ignored: Any = None  # DDP's ignore list before install_host_optimizer

    # --- data parallel ---------------------------------------------------------------------
    def attach(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Reduce over ``ddp``'s process group with its communication hook (see module doc)."""
        if ddp.module is not self.model:
            raise ConfigError("attach the DDP model that wraps the planned model itself")
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
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True
        self._ready[self._bucket_of[fqn]].add(fqn)
        while self._next < len(self.buckets) and len(self._ready[self._next]) == len(
            self.buckets[self._next]
        ):
            self._launch(self._next)

    def _launch(self, index: int) -> None:
        """Flatten bucket ``index``'s gradients, drop them, start its reduction; then drain the
        bucket launched before it."""
        names = self.buckets[index]
        params = [self._params[f] for f in names]
        grads = [p.grad for p in params]
        present = [f for f, g in zip(names, grads, strict=True) if g is not None]
        self._next = index + 1
        if not present and self.world_size == 1:
            self._drain()
            return
        if len(params) == 1 and grads[0] is not None and grads[0].is_contiguous():
            flat = grads[0].view(-1)  # a lone gradient goes as it is
        else:
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
        for p in params:
            p.grad = None
        del grads
        if self.world_size > 1:
            bucket = _Bucket(index, index == len(self.buckets) - 1, flat, params)
            hook = self.hook or _default_hook
            future = hook(self.hook_state if self.hook else self.group, bucket)
            names_stepped = list(names)  # under data parallelism every parameter is reduced
        else:
            future = torch.futures.Future()
            future.set_result(flat)
            names_stepped = present
        del flat
        self._drain()
        self._inflight = (index, future, names_stepped)

    def _drain(self) -> None:
        """Wait for the bucket in flight, copy its reduced gradients to the host, step them."""
        if self._inflight is None:
            return
        index, future, names = self._inflight
        self._inflight = None
        reduced = future.wait()
        reduced = reduced[0] if isinstance(reduced, list) else reduced  # (numel,)
        host, copied = self._to_host(reduced)
        del reduced, future
        grads, offset = {}, 0
        for fqn in self.buckets[index]:
            numel = self._params[fqn].numel()
            if fqn in names:
                grads[fqn] = host[offset : offset + numel].view_as(self._params[fqn])
            offset += numel
        self.launched_bytes += host.numel() * host.element_size()
        if self._worker is None:
            self.optimizer.step(grads)  # CPU: here, in order (bitwise reproducible)
        else:  # CUDA: the host steps beside backward once the copy has landed
            self._steps.append(self._worker.submit(self._step_when_copied, copied, grads))

    def _step_when_copied(self, copied: Any, grads: dict[str, torch.Tensor]) -> None:
        with torch.cuda.device(self._device):
            copied.synchronize()  # this worker thread waits, not backward's
            self.optimizer.step(grads)

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
