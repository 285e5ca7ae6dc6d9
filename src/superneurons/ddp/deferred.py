"""Compression configured before the process group exists, for frameworks that register the
comm hook themselves — PyTorch Lightning's ``DDPStrategy(ddp_comm_hook=...)``::

    compression = DeferredCompression(lightning_module, "fft:theta=0.9,bits=8")
    strategy = DDPStrategy(ddp_comm_state=compression, ddp_comm_hook=deferred_compression_hook)

The options are validated at construction (a bad spec fails before any process starts). At the
first backward, the hook binds to the default process group: it builds the
:class:`~superneurons.ddp.state.CompressionState` and runs the same cross-rank
configuration check as :func:`~superneurons.ddp.hook.register_compression` — from the hook
body of bucket 0, which every rank reaches first, so the collective order is fixed.
PyTorch's own hooks (``torch-*`` anchors, ``dense``) register themselves; use them directly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from superneurons.ddp.hook import (
    check_config_across_ranks,
    compression_hook,
    resolve,
    state_for,
)
from superneurons.ddp.state import CompressionState
from superneurons.ddp.torch_hooks import as_comm_hook
from superneurons.errors import ConfigError
from superneurons.schemes.anchors import TorchDense, TorchFp16, TorchPowerSGD
from superneurons.schemes.compose import Compression

__all__ = ["DeferredCompression", "deferred_compression_hook"]


class DeferredCompression:
    """The comm-hook state for :func:`deferred_compression_hook`; binds at the first backward.

    Args:
        module: the model DDP will wrap (parameter names key the error-feedback state).
        compression, seed: as for :func:`~superneurons.ddp.hook.register_compression`.
    """

    def __init__(
        self, module: torch.nn.Module, compression: Compression | str, *, seed: int = 0
    ) -> None:
        compression, pipeline = resolve(compression)
        base = pipeline.base
        if isinstance(base, (TorchDense, TorchFp16, TorchPowerSGD)):
            raise ConfigError(
                f"{base.spec} is one of PyTorch's own hooks, and DeferredCompression is for "
                "superneurons codecs: use register_compression(ddp, spec), or with Lightning "
                f"CompressedDDPStrategy({base.spec!r}) (Lightning skips ddp_comm_hook off CUDA)"
            )
        self.module = module
        self._compression = compression
        self._pipeline = pipeline
        self._seed = seed
        self._pending: dict[str, Any] | None = None
        self.state: CompressionState | None = None

    def bind(self) -> CompressionState:
        """The bound state (built, and checked across ranks, on first use)."""
        if self.state is None:
            if not dist.is_initialized():
                raise ConfigError("torch.distributed is not initialised: DDP must wrap the model")
            state = state_for(self.module, self._compression, self._pipeline, seed=self._seed)
            if state.auto is not None:
                raise ConfigError("auto needs register_compression (it measures at registration)")
            check_config_across_ranks(self.module, state)
            if self._pending is not None:
                state.load_state_dict(self._pending)
                self._pending = None
            self.state = state
        return self.state

    def state_dict(self) -> dict[str, Any]:
        """The compression state (empty before the first backward, unless one was loaded)."""
        if self.state is not None:
            return self.state.state_dict()
        return dict(self._pending or {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint now, or at binding if the first backward has not run yet."""
        if self.state is not None:
            self.state.load_state_dict(state)
        else:
            self._pending = dict(state)


@as_comm_hook
def deferred_compression_hook(
    state: DeferredCompression, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook over a :class:`DeferredCompression` (see the module docs)."""
    return compression_hook(state.bind(), bucket)
