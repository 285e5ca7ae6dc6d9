"""PyTorch's own DDP communication as anchors: ``dense``, ``torch-fp16``, ``torch-powersgd``.

Benchmarks compare our codecs against what a PyTorch user already has:

* ``dense`` / ``torch-allreduce``: no hook, DDP's built-in fp32 all-reduce;
* ``torch-fp16``: ``default_hooks.fp16_compress_hook`` (divide by world size, cast, all-reduce);
* ``torch-powersgd:rank=4``: ``powerSGD_hook.powerSGD_hook`` with a ``PowerSGDState``
  (Vogels et al., NeurIPS'19). NOTE: it issues its second all-reduce from a future callback
  and crashed with more than one bucket on gloo (benchmarks/results/network/README.md); use a large
  ``bucket_cap_mb`` with it on gloo, or our ``powersgd`` which is multi-bucket safe.

Their names are in the one spec table (:mod:`superneurons.schemes.grammar`); ``torch-allreduce``
is an alias of ``dense``.
"""

from __future__ import annotations

import logging
import typing
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from superneurons.codecs.powersgd import PowerSGD
from superneurons.ddp.state import CompressionState
from superneurons.schemes.anchors import TorchDense, TorchFp16, TorchPowerSGD

__all__ = ["as_comm_hook", "register_anchor"]

logger = logging.getLogger("superneurons.compress")


def as_comm_hook(hook: Any) -> Any:
    """Turn ``hook``'s string annotations (``from __future__ import annotations``) into the
    objects DDP's ``register_comm_hook`` compares them with."""
    hook.__annotations__ = typing.get_type_hints(hook)
    return hook


def _dense_bytes(bucket: dist.GradBucket) -> int:
    buffer = bucket.buffer()
    return buffer.numel() * 4


def register_anchor(ddp_model: DistributedDataParallel, state: CompressionState) -> None:
    """Install the anchor ``state.pipeline.base`` on ``ddp_model`` (no hook for dense).

    The wrappers map onto torch's own options: ``Warmup(steps=N)`` is ``start_powerSGD_iter``
    (at least 2, torch's minimum) and ``ErrorFeedback`` is ``use_error_feedback``.
    """
    anchor = state.pipeline.base
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if isinstance(anchor, TorchDense):
        # NOTE: no hook at all, the honest anchor; bytes are known without looking.
        params = [p for p in ddp_model.parameters() if p.requires_grad]
        dense = sum(p.numel() * p.element_size() for p in params)
        state.bytes_sent_step = state.dense_bytes_step = dense
        state.torch_state = None
        _count_steps_without_hook(ddp_model, state, dense)
        return
    if isinstance(anchor, TorchFp16):

        def fp16_hook(
            st: CompressionState, bucket: dist.GradBucket
        ) -> torch.futures.Future[torch.Tensor]:
            if bucket.index() == 0:
                st.begin_step()
            st.count(sent_bytes=bucket.buffer().numel() * 2, dense_bytes=_dense_bytes(bucket))
            group = st.process_group or dist.group.WORLD
            fut = default_hooks.fp16_compress_hook(group, bucket)  # type: ignore[arg-type]
            if bucket.is_last():
                st.end_step()
            return fut

        ddp_model.register_comm_hook(state, as_comm_hook(fp16_hook))
        return
    if not isinstance(anchor, TorchPowerSGD):
        raise TypeError(f"not one of PyTorch's hooks: {anchor!r}")
    torch_state = powerSGD_hook.PowerSGDState(
        process_group=state.process_group,
        matrix_approximation_rank=anchor.rank,
        start_powerSGD_iter=max(2, state.pipeline.warmup_steps),
        use_error_feedback=state.pipeline.error_feedback,
        warm_start=True,
        random_seed=state.seed,
    )
    state.torch_state = torch_state
    estimate = PowerSGD(rank=anchor.rank)

    def powersgd_hook(
        st: CompressionState, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        if bucket.index() == 0:
            st.begin_step()
        dense = _dense_bytes(bucket)
        # NOTE: an estimate (torch's hook keeps no byte counter): factors of every matrix it
        # compresses (min_compression_rate=2 is close to our "factors smaller" rule).
        compressed = st.step >= torch_state.start_powerSGD_iter
        shapes = [tuple(p.shape) for p in bucket.parameters()]
        st.count(
            sent_bytes=estimate.payload_bytes(shapes) if compressed else dense, dense_bytes=dense
        )
        fut = powerSGD_hook.powerSGD_hook(torch_state, bucket)
        if bucket.is_last():
            st.end_step()
        return fut

    ddp_model.register_comm_hook(state, as_comm_hook(powersgd_hook))


def _count_steps_without_hook(
    ddp_model: DistributedDataParallel, state: CompressionState, dense_bytes: int
) -> None:
    """Advance ``state.step`` once per forward in training mode (no hook to count with)."""

    def after_forward(module: torch.nn.Module, _inputs: Any, _output: Any) -> None:
        if module.training and torch.is_grad_enabled():
            state.begin_step()
            state.count(sent_bytes=dense_bytes, dense_bytes=dense_bytes)
            state.end_step()

    ddp_model.register_forward_hook(after_forward)
