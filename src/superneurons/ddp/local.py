"""DDP without its all-reduce, for optimizers that communicate themselves.

:class:`~superneurons.optim.adam.CompressedAdamW` averages compressed momentum (1-bit Adam) or
updates in ``step()``; DDP must then leave each rank's gradient as it is. DDP hands a comm hook
the bucket of unaveraged local gradients, so a hook that returns it unchanged keeps them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from superneurons.ddp.torch_hooks import as_comm_hook
from superneurons.errors import ConfigError

__all__ = ["register_local_gradients"]


def register_local_gradients(ddp_model: DistributedDataParallel) -> None:
    """Make ``ddp_model`` leave each rank's gradient local (no all-reduce in backward).

    For optimizers that communicate themselves (:class:`CompressedAdamW`). DDP hands the hook
    the bucket of unaveraged local gradients; returning it unchanged keeps them.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise ConfigError(
            f"register_local_gradients needs a DistributedDataParallel model, got "
            f"{type(ddp_model).__name__}"
        )

    ddp_model.register_comm_hook(None, _local_gradients_hook)


@as_comm_hook
def _local_gradients_hook(_: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
