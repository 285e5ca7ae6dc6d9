"""PyTorch Lightning: compressed gradient averaging through ``DDPStrategy``'s comm hook.

``CompressedDDPStrategy(compression)`` is a ``DDPStrategy`` with ``ddp_comm_state=compression``
and ``ddp_comm_hook=deferred_compression_hook``. NOTE: Lightning (checked on 2.6.6) registers
``ddp_comm_hook`` only when the root device is CUDA — on CPU/gloo it silently trains without
the hook, a restriction from PyTorch 1.8 that no longer exists — so this subclass registers it
on every device type. Requires ``pip install lightning``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy

from superneurons.compress.deferred import DeferredCompression, deferred_compression_hook

__all__ = ["CompressedDDPStrategy"]


class CompressedDDPStrategy(DDPStrategy):
    """``DDPStrategy`` averaging gradients through a :class:`DeferredCompression`."""

    def __init__(self, compression: DeferredCompression, **kwargs: Any) -> None:
        super().__init__(
            ddp_comm_state=compression, ddp_comm_hook=deferred_compression_hook, **kwargs
        )
        self.compression = compression

    def _register_ddp_hooks(self) -> None:
        if self.root_device.type == "cuda":
            super()._register_ddp_hooks()
            return
        self.model.register_comm_hook(self.compression, deferred_compression_hook)  # type: ignore[union-attr,operator]
