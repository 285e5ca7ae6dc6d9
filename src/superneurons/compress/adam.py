"""AdamW that averages compressed *updates* across ranks instead of compressed gradients.

Why: with AdamW, gradient compression stalls language models (char-GPT on Shakespeare:
top-k, FFT, TernGrad and scaled sign with error feedback all stop near 3.3 nats against
dense's 2.41, ``benchmarks/results/convergence``). Adam divides every coordinate by the RMS of
its own history; a sparse or sign-compressed gradient gives coordinates a history of rare
large values, and error feedback returns the dropped mass late, in bursts, which the
normalisation amplifies. Error feedback is sound for updates that are *linear* in what is
compressed (Karimireddy et al., ICML 2019); Adam's update is not linear in the gradient.

What this does (measured in ``benchmarks/results/convergence/adam.md``): every rank runs
AdamW's moment estimates on its *own* gradient (local, never communicated), forms its local
update ``u = m̂ / (√v̂ + ε)``, and the ranks average ``u`` through a codec with error feedback
in update space, where the step *is* linear: ``θ ← θ − lr·(avg(C(u + e)) + λθ)``. Every rank
applies the same averaged update, so parameters stay identical. Adam's update is already
close to a sign (each coordinate about ±1 in steady state: Kingma & Ba, ICLR 2015, §2.1;
Balles & Hennig, ICML 2018), which is why a 1-bit scaled sign loses little here.

Related: 1-bit Adam (Tang et al., ICML 2021) and 0/1 Adam (Lu et al., ICLR 2023) compress
the momentum after freezing the variance from a dense warm-up; that needs the warm-up long
enough for the variance to settle (with 10 of 200 steps it diverged on the char-GPT, with 20
it matched dense but sent only 7.8x fewer bytes, see the results).

Use with DDP: wrap the model (DDP broadcasts the initial parameters), then
``register_local_gradients(ddp)`` so DDP does not average gradients densely, and step this
optimizer; it issues one collective per step from ``step()``, the same on every rank.
"""

from __future__ import annotations

import logging
import re
import zlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from superneurons.compress.codec import Codec, Payload
from superneurons.compress.feedback import feedback_step
from superneurons.compress.torch_hooks import as_comm_hook
from superneurons.errors import ConfigError

__all__ = ["CompressedAdamW", "parse_update_spec", "register_local_gradients"]

logger = logging.getLogger("superneurons.compress")


_UPDATE_SPEC = re.compile(r"^adam-update(?:\[warmup=(\d+)\])?:(.+)$")


def parse_update_spec(text: str) -> tuple[Codec, int] | None:
    """``"adam-update[warmup=10]:signsgd"`` -> (codec, warm-up steps); other text -> None.

    The codec part is any spec of :func:`superneurons.compress.spec.parse_spec`.
    """
    match = _UPDATE_SPEC.match(text.strip())
    if match is None:
        return None
    from superneurons.compress.spec import parse_codec

    return parse_codec(match.group(2)), int(match.group(1) or 0)


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


class CompressedAdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter, ICLR 2019) whose ranks exchange compressed local updates.

    Args:
        params: parameters (or groups); each rank must pass them in the same order.
        codec: the codec for the update (e.g. ``parse_spec("signsgd")``); error feedback
            (per parameter, in update space) is always on.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        warmup_steps: the first steps average the updates uncompressed (fp32).
        process_group: the group to average over (default: the world; none initialised:
            a single process, nothing is sent).
        seed: seeds stochastic codecs (per rank, step and parameter).

    ``bytes_sent_total`` counts what this rank put on the wire (payload bytes), comparable
    with ``CompressionState.bytes_sent_total`` of the gradient hook.
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        codec: Codec,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        seed: int = 0,
    ) -> None:
        if not lr > 0 or not eps > 0 or weight_decay < 0:
            raise ConfigError(
                f"lr > 0, eps > 0, weight_decay >= 0; got {lr}, {eps}, {weight_decay}"
            )
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ConfigError(f"betas must be two numbers in [0, 1), got {betas}")
        if warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if not isinstance(codec, Codec):
            raise ConfigError(f"codec must be a Codec (parse_spec('signsgd')), got {codec!r}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.codec = codec
        self.warmup_steps = warmup_steps
        self.process_group = process_group
        self.seed = seed
        self.steps = 0
        self.bytes_sent_step = 0
        self.bytes_sent_total = 0
        self.dense_bytes_total = 0

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["compression"] = {
            "steps": self.steps,
            "bytes_sent_total": self.bytes_sent_total,
            "dense_bytes_total": self.dense_bytes_total,
            "codec": self.codec.spec,
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        extra = state.pop("compression", None)
        if extra is None:
            raise ConfigError("not a CompressedAdamW state_dict (no 'compression' entry)")
        if extra["codec"] != self.codec.spec:
            raise ConfigError(
                f"checkpoint was written with codec {extra['codec']!r}, this optimizer uses "
                f"{self.codec.spec!r}: the error-feedback residuals would not match"
            )
        super().load_state_dict(state)
        self.steps = int(extra["steps"])
        self.bytes_sent_total = int(extra["bytes_sent_total"])
        self.dense_bytes_total = int(extra["dense_bytes_total"])

    # -- the step ----------------------------------------------------------------------------
    def _world(self) -> tuple[int, int]:
        if not dist.is_available() or not dist.is_initialized():
            return 1, 0
        group = self.process_group
        return dist.get_world_size(group), dist.get_rank(group)

    def _local_update(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """AdamW's update direction from this rank's own gradient (moments kept locally).

        Same arithmetic as ``torch.optim.AdamW`` (single-tensor path), without the lr.
        """
        beta1, beta2 = group["betas"]
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["residual"] = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        grad = p.grad
        assert grad is not None
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad.conj(), value=1 - beta2)
        bias_correction1 = 1 - beta1**self.steps
        bias_correction2_sqrt = (1 - beta2**self.steps) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
        return (exp_avg / denom / bias_correction1).reshape(-1)  # (numel,)

    def _generator(self, rank: int, index: int, device: torch.device) -> torch.Generator:
        key = f"{self.seed}/{rank}/{self.steps}/{index}".encode()
        return torch.Generator(device=device).manual_seed(zlib.crc32(key))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One AdamW step with the averaged (compressed) update. Collective when distributed."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.steps += 1
        world, rank = self._world()
        params = [
            (p, group) for group in self.param_groups for p in group["params"] if p.grad is not None
        ]
        updates = [self._local_update(p, group) for p, group in params]
        dense = self.steps <= self.warmup_steps
        if dense:
            averaged, sent = self._average_dense(updates, world)
        else:
            averaged, sent = self._average_compressed(params, updates, world, rank)
        for (p, group), update in zip(params, averaged, strict=True):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update.view_as(p).to(p.dtype), alpha=-group["lr"])
        self.bytes_sent_step = sent
        self.bytes_sent_total += sent
        self.dense_bytes_total += sum(4 * u.numel() for u in updates)
        return loss

    def _average_dense(
        self, updates: list[torch.Tensor], world: int
    ) -> tuple[list[torch.Tensor], int]:
        flat = torch.cat(updates) if updates else torch.zeros(0)
        if world > 1 and flat.numel():
            dist.all_reduce(flat, group=self.process_group)
            flat /= world
        return list(torch.split(flat, [u.numel() for u in updates])), 4 * flat.numel()

    def _average_compressed(
        self,
        params: list[tuple[torch.Tensor, dict[str, Any]]],
        updates: list[torch.Tensor],
        world: int,
        rank: int,
    ) -> tuple[list[torch.Tensor], int]:
        codec = self.codec
        payloads: list[Payload] = []
        for index, ((p, _), update) in enumerate(zip(params, updates, strict=True)):
            state = self.state[p]
            generator = self._generator(rank, index, update.device)
            payload, state["residual"] = feedback_step(
                codec, update, state["residual"], generator=generator
            )
            payloads.append(payload)
        if not payloads:
            return [], 0
        # NOTE: parts are cloned before decoding: a slice at an odd byte offset cannot be
        # viewed as float32 (the codecs' scales and values).
        sizes = [payload.data.numel() for payload in payloads]
        message = torch.cat([payload.data for payload in payloads])  # one collective per step
        sent = message.numel() * message.element_size()
        if codec.summable:
            if world > 1:
                dist.all_reduce(message, group=self.process_group)
            parts = torch.split(message, sizes)
            summed = [
                codec.decode(Payload(part.clone(), u.numel()))
                for part, u in zip(parts, updates, strict=True)
            ]
        else:
            gathered = message
            if world > 1:
                gathered = message.new_empty(world * message.numel())
                dist.all_gather_into_tensor(gathered, message, group=self.process_group)
            per_rank = [torch.split(chunk, sizes) for chunk in gathered.chunk(world)]
            summed = [
                codec.decode_sum([Payload(parts[i].clone(), u.numel()) for parts in per_rank])
                for i, u in enumerate(updates)
            ]
        return [s.div_(world) for s in summed], sent
