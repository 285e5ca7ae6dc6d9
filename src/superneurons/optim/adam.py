"""AdamW whose ranks exchange compressed *momentum* (or updates) instead of gradients.

Why: with AdamW, gradient compression stalls language models (char-GPT on Shakespeare:
top-k, FFT, TernGrad and scaled sign with error feedback all stop near 3.3 nats against
dense's 2.41, ``benchmarks/results/convergence``). Adam divides every coordinate by the RMS of
its own history; a sparse or sign-compressed gradient gives coordinates a history of rare
large values, and error feedback returns the dropped mass late, in bursts, which the
normalisation amplifies. Error feedback is sound where the step is *linear* in what is
compressed (Karimireddy et al., ICML 2019); Adam's update is not linear in the gradient.

Two ways to make the compressed quantity enter linearly (``mode``):

* ``"momentum"`` (1-bit Adam: Tang et al., "1-bit Adam: Communication Efficient Large-Scale
  Training with Adam's Convergence Speed", ICML 2021): ``warmup_steps`` of plain AdamW on
  averaged gradients (optionally fp16/bf16 on the wire), then the second moment ``v`` is
  frozen and each rank's momentum ``m_r = β1·m + (1−β1)·g_r`` is averaged through the codec
  with error feedback; the step ``m̂ / (√v̂_frozen + ε)`` is then linear in ``m``.
* ``"update"``: every rank keeps its own moments and the local updates
  ``m̂_r / (√v̂_r + ε)`` are averaged through the codec with error feedback (no warm-up
  needed, but per-rank moments see a smaller batch: the uncompressed variant alone lost
  0.12 nats on the char-GPT).

Measured on the char-GPT (``benchmarks/results/convergence/README.md``): momentum mode with a
scaled-sign codec tracks dense within a few hundredths of a nat after a 20-step warm-up;
with a 10-step warm-up it diverged (the frozen ``v`` is too small for some coordinates).

Use with DDP: wrap the model (DDP broadcasts the initial parameters), then
``register_local_gradients(ddp)`` so DDP does not average gradients, and step this optimizer;
it issues one collective per step from ``step()``, the same on every rank. A spec
(``adam-momentum[warmup=20,wire=fp16]:signsgd``) names its options as a scheme object
(:mod:`superneurons.schemes.adam`, ``CompressedAdamW(params, **scheme.kwargs())``).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from superneurons.codecs.codec import Codec, Payload
from superneurons.codecs.feedback import feedback_step
from superneurons.codecs.twophase import TwoPhase
from superneurons.compat import all_gather_into_tensor
from superneurons.ddp.twophase import TwoPhaseState, average_
from superneurons.errors import ConfigError

__all__ = [
    "MODES",
    "CompressedAdamW",
]

MODES = ("momentum", "update")


class CompressedAdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter, ICLR 2019) whose ranks exchange compressed local updates.

    Args:
        params: parameters (or groups); each rank must pass them in the same order.
        codec: the codec for the momentum or update (e.g. ``parse_spec("signsgd")``); error
            feedback (per parameter) is always on.
        mode: ``"momentum"`` (1-bit Adam, needs ``warmup_steps >= 1``) or ``"update"``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        warmup_steps: the first steps average gradients (momentum mode) or updates (update
            mode) through ``warmup_codec``.
        warmup_codec: a summable codec for the warm-up (``fp16``, ``bf16``); None: fp32.
        clip_rms: momentum mode: scale each tensor's frozen-variance direction down to this
            RMS when above it (Adafactor's update clipping, Shazeer & Stern, ICML 2018, d=1):
            a guard against coordinates whose frozen ``v`` is near zero. None: off.
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
        codec: Codec | TwoPhase,
        mode: str = "momentum",
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        warmup_steps: int = 0,
        warmup_codec: Codec | None = None,
        clip_rms: float | None = None,
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
        if not isinstance(codec, Codec | TwoPhase):
            raise ConfigError(
                f"codec must be a Codec (parse_spec('signsgd')) or TwoPhase, got {codec!r}"
            )
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "momentum" and warmup_steps < 1:
            raise ConfigError(
                "mode='momentum' freezes Adam's second moment after a dense warm-up: set "
                "warmup_steps >= 1 (about 10% of the run; 20 of 200 steps on the char-GPT)"
            )
        if clip_rms is not None and not clip_rms > 0:
            raise ConfigError(f"clip_rms must be > 0 or None, got {clip_rms}")
        if warmup_codec is not None and not warmup_codec.summable:
            raise ConfigError(
                f"warmup_codec must be summable (fp16, bf16, identity), got {warmup_codec.spec}"
            )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.codec = codec
        self.mode = mode
        self.warmup_codec = warmup_codec
        self.clip_rms = clip_rms
        self.warmup_steps = warmup_steps
        self.process_group = process_group
        self.seed = seed
        self.steps = 0
        self.bytes_sent_step = 0
        self.bytes_sent_total = 0
        self.dense_bytes_step = 0
        self.dense_bytes_total = 0
        # the two-phase exchange's residuals (worker and owned slice) by parameter position
        self.twophase = TwoPhaseState(seed=seed) if isinstance(codec, TwoPhase) else None

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["compression"] = {
            "steps": self.steps,
            "bytes_sent_total": self.bytes_sent_total,
            "dense_bytes_total": self.dense_bytes_total,
            "codec": self.codec.spec,
            "mode": self.mode,
        }
        if self.twophase is not None:
            state["compression"]["twophase"] = self.twophase.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        extra = state.pop("compression", None)
        if extra is None:
            raise ConfigError("not a CompressedAdamW state_dict (no 'compression' entry)")
        if (extra["codec"], extra["mode"]) != (self.codec.spec, self.mode):
            raise ConfigError(
                f"checkpoint was written with codec {extra['codec']!r} in mode "
                f"{extra['mode']!r}, this optimizer uses {self.codec.spec!r} in mode "
                f"{self.mode!r}: the error-feedback residuals would not match"
            )
        super().load_state_dict(state)
        self.steps = int(extra["steps"])
        self.bytes_sent_total = int(extra["bytes_sent_total"])
        self.dense_bytes_total = int(extra["dense_bytes_total"])
        if self.twophase is not None:
            self.twophase.load_state_dict(extra["twophase"])

    # -- the step ----------------------------------------------------------------------------
    def _world(self) -> tuple[int, int]:
        if not dist.is_available() or not dist.is_initialized():
            return 1, 0
        group = self.process_group
        return dist.get_world_size(group), dist.get_rank(group)

    def _moments(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if self.twophase is None:  # the two-phase residuals live in self.twophase
                state["residual"] = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        return state

    def _adam_direction(
        self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]
    ) -> torch.Tensor:
        """AdamW's direction ``m̂ / (√v̂ + ε)`` after folding ``grad`` into ``p``'s moments.

        Same arithmetic as ``torch.optim.AdamW`` (single-tensor path), without the lr.
        """
        beta1, beta2 = group["betas"]
        state = self._moments(p)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad.conj(), value=1 - beta2)
        bias_correction1 = 1 - beta1**self.steps
        bias_correction2_sqrt = (1 - beta2**self.steps) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
        return (exp_avg / denom / bias_correction1).reshape(-1)  # (numel,)

    def _frozen_direction(
        self, p: torch.Tensor, momentum: torch.Tensor, group: dict[str, Any]
    ) -> torch.Tensor:
        """1-bit Adam's direction: the averaged momentum over the frozen second moment."""
        beta1, beta2 = group["betas"]
        state = self.state[p]
        state["exp_avg"].copy_(momentum.view_as(p))
        bias_correction1 = 1 - beta1**self.steps
        bias_correction2_sqrt = (1 - beta2**self.warmup_steps) ** 0.5
        denom = (state["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(group["eps"])
        direction = (state["exp_avg"] / denom / bias_correction1).reshape(-1)
        if self.clip_rms is not None:  # no host sync: a tensor scale
            rms = direction.square().mean().sqrt()
            direction /= torch.clamp(rms / self.clip_rms, min=1.0)
        return direction

    def _generator(self, rank: int, index: int, device: torch.device) -> torch.Generator:
        key = f"{self.seed}/{rank}/{self.steps}/{index}".encode()
        return torch.Generator(device=device).manual_seed(zlib.crc32(key))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One AdamW step with averaged (compressed) momentum or updates. Collective."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.steps += 1
        world, rank = self._world()
        params = [
            (p, group) for group in self.param_groups for p in group["params"] if p.grad is not None
        ]
        grads = [p.grad.reshape(-1) for p, _ in params if p.grad is not None]
        warm = self.steps <= self.warmup_steps
        if self.mode == "update":
            local = [
                self._adam_direction(p, g.view_as(p), gr)
                for (p, gr), g in zip(params, grads, strict=True)
            ]
            if warm:
                updates, sent = self._average_dense(local, world)
            else:
                updates, sent = self._average_compressed(params, local, world, rank)
        elif warm:  # momentum mode, warm-up: plain AdamW on the averaged gradient
            averaged, sent = self._average_dense(grads, world)
            updates = [
                self._adam_direction(p, g.view_as(p), gr)
                for (p, gr), g in zip(params, averaged, strict=True)
            ]
        else:  # momentum mode, frozen v: average each rank's next momentum
            local = []
            for (p, group), g in zip(params, grads, strict=True):
                momentum = self._moments(p)["exp_avg"].reshape(-1)
                local.append(torch.lerp(momentum, g.to(momentum.dtype), 1 - group["betas"][0]))
            averaged, sent = self._average_compressed(params, local, world, rank)
            updates = [
                self._frozen_direction(p, m, gr)
                for (p, gr), m in zip(params, averaged, strict=True)
            ]
        for (p, group), update in zip(params, updates, strict=True):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update.view_as(p).to(p.dtype), alpha=-group["lr"])
        self.bytes_sent_step = sent
        self.bytes_sent_total += sent
        self.dense_bytes_step = sum(4 * g.numel() for g in grads)  # an fp32 all-reduce's input
        self.dense_bytes_total += self.dense_bytes_step
        return loss

    def _average_dense(
        self, tensors: list[torch.Tensor], world: int
    ) -> tuple[list[torch.Tensor], int]:
        """Average across ranks in fp32 or through the summable ``warmup_codec``."""
        flat = torch.cat([t.float() for t in tensors]) if tensors else torch.zeros(0)
        sizes = [t.numel() for t in tensors]
        if self.warmup_codec is None:
            if world > 1 and flat.numel():
                dist.all_reduce(flat, group=self.process_group)
            return list(torch.split(flat / world, sizes)), 4 * flat.numel()
        payload = self.warmup_codec.encode(flat / world)  # pre-divided: no fp16 overflow
        if world > 1:
            dist.all_reduce(payload.data, group=self.process_group)
        return list(torch.split(self.warmup_codec.decode(payload), sizes)), payload.nbytes

    def _average_compressed(
        self,
        params: list[tuple[torch.Tensor, dict[str, Any]]],
        updates: list[torch.Tensor],
        world: int,
        rank: int,
    ) -> tuple[list[torch.Tensor], int]:
        codec = self.codec
        if isinstance(codec, TwoPhase):
            return self._average_twophase(codec, updates, world, rank)
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
        # NOTE: parts are cloned before decoding: an odd byte offset cannot be viewed as fp32.
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
                all_gather_into_tensor(gathered, message, group=self.process_group)
            per_rank = [torch.split(chunk, sizes) for chunk in gathered.chunk(world)]
            summed = [
                codec.decode_sum([Payload(parts[i].clone(), u.numel()) for parts in per_rank])
                for i, u in enumerate(updates)
            ]
        return [s.div_(world) for s in summed], sent

    def _average_twophase(
        self, config: TwoPhase, updates: list[torch.Tensor], world: int, rank: int
    ) -> tuple[list[torch.Tensor], int]:
        """Average through the two-phase exchange (:func:`superneurons.ddp.twophase.average_`):
        error feedback at the worker and at each slice's owner, bytes per rank independent of
        the world size; one exchange per step for every parameter."""
        averaged = [u.float().contiguous().clone() for u in updates]
        if world == 1 or not averaged:
            return averaged, 0
        assert self.twophase is not None

        def generators(key: str) -> torch.Generator:
            seed = f"{self.seed}/{rank}/{self.steps}/{key}".encode()
            return torch.Generator().manual_seed(zlib.crc32(seed))

        tensors = [(f"p{i}", flat, config) for i, flat in enumerate(averaged)]
        sent = average_(tensors, self.twophase, group=self.process_group, generators=generators)
        return averaged, sent
