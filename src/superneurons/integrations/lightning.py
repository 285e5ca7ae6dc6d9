"""PyTorch Lightning: compressed gradient averaging through ``DDPStrategy``'s comm hook.

``CompressedDDPStrategy(compression)`` is a ``DDPStrategy`` whose comm hook is registered on
every device type. NOTE: Lightning (checked on 2.6.6, ``DDPStrategy._register_ddp_hooks``)
registers ``ddp_comm_hook`` only when the root device is CUDA; on CPU/gloo it silently trains
with DDP's plain fp32 all-reduce, so e.g. PyTorch's ``fp16_compress_hook`` appears to compress
and never runs. The restriction dates from PyTorch 1.8; comm hooks work on gloo now.

``compression`` is one of:

* a spec string or codec object: our codecs (``"fft:theta=0.9,bits=8"``) and PyTorch's own
  hooks as anchors (``"torch-fp16"``, ``"torch-powersgd:rank=4"``, ``"dense"``), registered
  with :func:`~superneurons.compress.register_compression` once DDP wraps the model (so the
  bytes are counted in :attr:`CompressedDDPStrategy.compression_state`);
* a :class:`~superneurons.compress.DeferredCompression` (binds at the first backward);
* None, with a raw PyTorch hook in ``ddp_comm_hook=`` (and optionally ``ddp_comm_state=``,
  ``ddp_comm_wrapper=``): registered as Lightning would on CUDA, but on every device.

Requires ``pip install lightning``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from superneurons.compress import (
    CompressionState,
    DeferredCompression,
    deferred_compression_hook,
    register_compression,
)
from superneurons.errors import ConfigError
from superneurons.replicas import check_replicas

__all__ = ["CompressedDDPStrategy"]


class CompressedDDPStrategy(DDPStrategy):
    """``DDPStrategy`` whose gradient averaging goes through a comm hook on every device.

    Args:
        compression: a spec string or codec, a :class:`DeferredCompression`, or None (then
            ``ddp_comm_hook=`` must name a PyTorch hook).
        compression_options: ``register_compression`` options for a spec string or codec
            (``seed``, ``process_group``); error feedback, warm-up and θ schedules are wrappers
            in ``compression`` itself (``"ef(warmup(steps=100,topk:ratio=0.01))"``).
        kwargs: ``DDPStrategy`` arguments (``process_group_backend="gloo"``, ...).

    The hook's :class:`CompressionState` (bytes sent, ``state_dict``) is
    :attr:`compression_state` once it exists; None for a raw PyTorch hook. When training
    starts (after any checkpoint restore) the ranks check that they hold the same parameters
    and optimizer state (:func:`~superneurons.replicas.check_replicas`).
    """

    def __init__(
        self,
        compression: Any = None,
        *,
        compression_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        raw_hook = kwargs.get("ddp_comm_hook")
        if compression is None and raw_hook is None:
            raise ConfigError(
                "CompressedDDPStrategy needs compression= (e.g. 'fft:theta=0.9,bits=8' or "
                "'torch-fp16') or a PyTorch hook in ddp_comm_hook="
            )
        if compression is not None and any(
            kwargs.get(k) is not None
            for k in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper")
        ):
            raise ConfigError(
                "give either compression= or ddp_comm_hook=/ddp_comm_state=/ddp_comm_wrapper=, "
                "not both: a DDP model takes one comm hook"
            )
        if compression_options and isinstance(compression, DeferredCompression):
            raise ConfigError("a DeferredCompression carries its own options: drop them here")
        self._spec: Any = None
        self._spec_options = dict(compression_options or {})
        if isinstance(compression, DeferredCompression):
            kwargs.update(ddp_comm_state=compression, ddp_comm_hook=deferred_compression_hook)
        elif compression is not None:
            _validate(compression)  # a bad spec fails here, before any process starts
            self._spec = compression  # registered when DDP exists
        super().__init__(**kwargs)
        self.compression = compression
        self._state: CompressionState | None = None

    @property
    def compression_state(self) -> CompressionState | None:
        """The hook's state once it exists (a DeferredCompression binds at the first backward)."""
        if isinstance(self.compression, DeferredCompression):
            return self.compression.state
        return self._state

    def on_train_start(self) -> None:
        """After setup and any checkpoint restore: every rank holds the same parameters and
        optimizer state, or :class:`~superneurons.errors.ReplicaMismatchError` names a tensor."""
        super().on_train_start()
        model = self.model
        if isinstance(model, DistributedDataParallel):
            check_replicas(model, optimizers=self.optimizers, process_group=model.process_group)

    def _register_ddp_hooks(self) -> None:
        # NOTE: replaces DDPStrategy's, which does nothing unless the root device is CUDA.
        model = self.model
        if not isinstance(model, DistributedDataParallel):
            raise ConfigError("CompressedDDPStrategy: the model is not wrapped in DDP yet")
        if self._spec is not None:
            self._state = register_compression(model, self._spec, **self._spec_options)
            return
        hook = self._ddp_comm_hook
        if hook is None:
            return
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        model.register_comm_hook(state=self._ddp_comm_state, hook=hook)


def _validate(compression: Any) -> None:
    """Parse/validate ``compression`` with the hook's own resolver (no process group needed)."""
    from superneurons.ddp import hook

    # NOTE: `resolve` accepts a spec string or a composed object and raises ConfigError.
    hook.resolve(compression)
