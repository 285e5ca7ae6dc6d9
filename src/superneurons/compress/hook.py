"""Compressed gradient averaging as a DDP communication hook.

``state = register_compression(ddp_model, "fft:theta=0.9,bits=8")`` replaces DDP's fp32
all-reduce by a codec (Wang et al., HPDC'20, and the baselines in ``superneurons.compress``):

* summable payloads (identity, fp16, bf16) are divided by the world size, encoded and
  all-reduced; every other codec's fixed-size ``uint8`` payloads are all-gathered and turned
  into the average by one ``codec.decode_sum`` (FFT: summed spectra, one inverse FFT);
* each parameter's gradient is encoded on its own, but a bucket travels in ONE collective.
  NOTE: per parameter, not per bucket, so the result does not depend on DDP's bucket layout,
  which changes after the first step and again after a resume: a resumed run continues bit
  for bit, and ``bucket_cap_mb`` only changes the overlap, never the numbers;
* PowerSGD (``powersgd:rank=4``) runs its two all-reduces (see :mod:`.powersgd`);
* PyTorch's own hooks (``dense``, ``torch-fp16``, ``torch-powersgd``) are anchors
  (see :mod:`.torch_hooks`).

Safety rules, all of them learned from PyTorch's own hooks (CONTEXT §4):

* every collective is issued from the hook body, in the same order on every rank; the
  returned future only chains local work, so any number of buckets is safe on gloo;
* per-gradient state (error-feedback residuals, PowerSGD factors) is keyed by parameter
  name: DDP rebuilds its buckets after the first step, so bucket indices are not stable;
* :func:`register_compression` all-gathers a fixed-size digest of the configuration (codec
  spec, options, world size, parameter names and shapes) before the first step, so ranks
  configured differently fail at once with a :class:`ConfigError` on every rank;
* steps are counted once per backward pass: DDP calls the hook for bucket 0 first and marks
  the last bucket (``bucket.is_last()``); no hook runs under ``no_sync``.

Non-finite gradients: a rank whose (compensated) bucket holds NaN/Inf sets a flag byte next
to its payload (summable and PowerSGD messages carry the NaN through the sum), so the
averaged bucket is non-finite on ALL ranks, exactly as with dense all-reduce: a GradScaler
skips the step everywhere. Error-feedback residuals and PowerSGD factors are only updated
from finite values, so one bad step does not poison later ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from superneurons.compress.codec import Payload, all_finite
from superneurons.compress.hookstate import CompressionState, HookOptions
from superneurons.compress.powersgd import PowerSGD, PowerSGDState, powersgd_reduce
from superneurons.compress.torch_hooks import (
    TorchAnchor,
    as_comm_hook,
    register_anchor,
    resolve_spec,
)
from superneurons.errors import ConfigError

__all__ = ["CompressionState", "build_state", "register_compression", "resolve_codec"]

logger = logging.getLogger("superneurons.compress")

_TEXT_BYTES = 192  # fixed size of the human-readable part of the config check


def register_compression(
    ddp_model: DistributedDataParallel,
    codec_or_spec: Any,
    *,
    error_feedback: bool = True,
    warmup_steps: int = 0,
    theta_schedule: Any = None,
    process_group: dist.ProcessGroup | None = None,
    seed: int = 0,
) -> CompressionState:
    """Compress ``ddp_model``'s gradient averaging with ``codec_or_spec``.

    Collective: every rank calls it, before the first backward. It all-gathers the
    configuration digest right here (so a mismatch fails before any step, in milliseconds,
    never as a hang inside backward), then registers the comm hook.

    Args:
        ddp_model: a ``DistributedDataParallel`` model, before its first backward.
        codec_or_spec: a codec object or a spec string (``"fft:theta=0.9,bits=8"``,
            ``"powersgd:rank=4"``, ``"torch-fp16"``, ``"dense"``).
        error_feedback: keep what compression dropped and add it to the next gradient
            (Seide et al. 2014; Karimireddy et al. 2019), per parameter name.
        warmup_steps: this many first steps average densely (plain fp32 all-reduce).
        theta_schedule: ``ConstantTheta``/``DiminishingTheta`` (``theta(step)``) or
            ``ErrorBudgetTheta`` (``choose(grad, codec)``, agreed by an all-reduce MIN).
        process_group: the group to average over (default: the world).
        seed: seeds stochastic codecs (one generator per rank, step and parameter name)
            and PowerSGD's first ``Q`` (the same on every rank).

    Returns:
        The :class:`CompressionState` (counters, ``state_dict``/``load_state_dict``).

    Raises:
        ConfigError: bad options, or ranks configured differently (raised on every rank).
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise ConfigError(
            f"register_compression needs a DistributedDataParallel model, got "
            f"{type(ddp_model).__name__}; wrap it first: DistributedDataParallel(model)"
        )
    if not dist.is_initialized():
        raise ConfigError("torch.distributed is not initialised; call init_process_group first")
    module = ddp_model.module
    state = build_state(
        module,
        codec_or_spec,
        error_feedback=error_feedback,
        warmup_steps=warmup_steps,
        theta_schedule=theta_schedule,
        process_group=process_group,
        seed=seed,
    )
    codec, options, world_size, rank = state.codec, state.options, state.world_size, state.rank
    _check_config_across_ranks(module, options, world_size, process_group)
    if isinstance(codec, TorchAnchor):
        register_anchor(ddp_model, state)
    else:
        ddp_model.register_comm_hook(state, as_comm_hook(_compression_hook))
    logger.info("rank %d: compressing gradients with %s", rank, codec.spec)
    return state


def resolve_codec(codec_or_spec: Any, *, theta_schedule: Any = None) -> Any:
    """A codec object from a codec or a spec string, checked against ``theta_schedule``."""
    codec = resolve_spec(codec_or_spec) if isinstance(codec_or_spec, str) else codec_or_spec
    if not hasattr(codec, "spec") or not hasattr(codec, "summable"):
        raise ConfigError(f"{codec_or_spec!r} is neither a codec nor a spec string")
    if theta_schedule is not None:
        from superneurons.compress.schedule import with_theta

        if isinstance(codec, (PowerSGD, TorchAnchor)):
            raise ConfigError(f"{codec.spec} has no θ to schedule; use fft or topk")
        with_theta(codec, 0.5)  # raises ConfigError for codecs without a θ
    return codec


def build_state(
    module: torch.nn.Module,
    codec_or_spec: Any,
    *,
    error_feedback: bool = True,
    warmup_steps: int = 0,
    theta_schedule: Any = None,
    process_group: dist.ProcessGroup | None = None,
    seed: int = 0,
) -> CompressionState:
    """The hook's :class:`CompressionState` for ``module`` (the model DDP wraps); needs an
    initialised process group. Local: no collective."""
    codec = resolve_codec(codec_or_spec, theta_schedule=theta_schedule)
    options = HookOptions(
        spec=codec.spec,
        error_feedback=bool(error_feedback),
        warmup_steps=warmup_steps,
        seed=seed,
        theta_schedule=repr(theta_schedule) if theta_schedule is not None else "none",
    )
    return CompressionState(
        options=options,
        codec=codec,
        process_group=process_group,
        world_size=dist.get_world_size(process_group),
        rank=dist.get_rank(process_group),
        names_by_param={id(p): name for name, p in module.named_parameters()},
        theta_schedule=theta_schedule,
        powersgd=PowerSGDState(seed=seed) if isinstance(codec, PowerSGD) else None,
    )


def _check_config_across_ranks(
    module: torch.nn.Module,
    options: HookOptions,
    world_size: int,
    group: dist.ProcessGroup | None,
) -> None:
    """All-gather a fixed-size digest of the configuration; raise on every rank if they differ."""
    params = [(n, list(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    described = {"options": options.__dict__, "world_size": world_size, "params": params}
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).digest()
    text = f"{options.spec} ef={options.error_feedback} warmup={options.warmup_steps}"
    text += f" seed={options.seed} theta={options.theta_schedule} params={len(params)}"
    raw = digest + text.encode()[:_TEXT_BYTES].ljust(_TEXT_BYTES, b"\0")
    # NOTE: on the parameters' device: NCCL only moves CUDA tensors.
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    gathered = torch.empty(world_size * mine.numel(), dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(gathered, mine, group=group)
    rows = gathered.view(world_size, -1).cpu()
    differing = [r for r in range(world_size) if not torch.equal(rows[r], rows[0])]
    if differing:
        described_ranks = "; ".join(f"rank {r}: {_text(rows[r, 32:])}" for r in [0, *differing])
        raise ConfigError(
            "ranks are configured differently (codec, options, world size or model "
            f"parameters): {described_ranks}; launch every rank with the same settings"
        )


def _text(row: torch.Tensor) -> str:
    return bytes(row.tolist()).rstrip(b"\0").decode(errors="replace")


def _names_and_pieces(
    state: CompressionState, bucket: dist.GradBucket
) -> list[tuple[str, torch.Tensor]]:
    """Split the flat bucket into (parameter name, view shaped like the parameter)."""
    buffer = bucket.buffer()
    pieces: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for param in bucket.parameters():
        name = state.names_by_param.get(id(param))
        if name is None:
            raise ConfigError("a DDP bucket holds a parameter the module does not name")
        pieces.append((name, buffer[offset : offset + param.numel()].view(param.shape)))
        offset += param.numel()
    if offset != buffer.numel():
        raise ConfigError(f"bucket of {buffer.numel()} elements, parameters hold {offset}")
    return pieces


def _compression_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The DDP comm hook: one bucket in, the averaged bucket out (see the module docs)."""
    if bucket.index() == 0:
        state.begin_step()
    buffer = bucket.buffer()
    dense_bytes = buffer.numel() * 4
    group, world_size = state.process_group, state.world_size
    if state.step < state.options.warmup_steps:
        buffer.div_(world_size)
        work = dist.all_reduce(buffer, group=group, async_op=True)
        state.count(sent_bytes=buffer.numel() * buffer.element_size(), dense_bytes=dense_bytes)
        fut = work.get_future().then(lambda f: f.value()[0])
    elif isinstance(state.codec, PowerSGD):
        residuals = state.residuals if state.options.error_feedback else None
        fut, sent = powersgd_reduce(
            state.codec,
            state.powersgd,
            _names_and_pieces(state, bucket),
            buffer,
            residuals=residuals,
            group=group,
            world_size=world_size,
        )
        state.count(sent_bytes=sent, dense_bytes=dense_bytes)
    elif state.codec.summable:
        fut = _summable_reduce(state, bucket)
    else:
        fut = _gathered_reduce(state, bucket)
    if bucket.is_last():
        state.end_step()
    return fut


def _compensated(
    state: CompressionState, pieces: list[tuple[str, torch.Tensor]]
) -> list[torch.Tensor]:
    """Each parameter's flat fp32 gradient plus its error-feedback residual."""
    use_ef = state.options.error_feedback
    out = []
    for name, piece in pieces:
        flat = piece.reshape(-1).float()
        out.append(flat + state.residuals[name] if use_ef and name in state.residuals else flat)
    return out


def _store_residuals(
    state: CompressionState, pieces: list[tuple[str, torch.Tensor]], errors: list[torch.Tensor]
) -> None:
    for (name, _), error in zip(pieces, errors, strict=True):
        state.residuals[name] = error


def _summable_reduce(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Cast codecs (identity, fp16, bf16): encode the whole bucket, one all-reduce.

    NOTE: summable codecs are element-wise (a per-message scale could not be summed), so
    encoding the bucket at once equals encoding each parameter: no per-parameter loop here.
    """
    buffer = bucket.buffer()
    world_size = state.world_size
    pieces = _names_and_pieces(state, bucket)
    compensated = torch.cat(_compensated(state, pieces))
    # Divide before encoding, as DDP does, so fp16 sums cannot overflow.
    payload = state.codec.encode(compensated / world_size)
    if state.options.error_feedback and state.codec.spec != "identity":  # identity drops nothing
        error = compensated - state.codec.decode(payload) * world_size
        if all_finite(error):
            _store_residuals(state, pieces, list(error.split([p.numel() for _, p in pieces])))
    wire = payload.data.reshape(-1)
    work = dist.all_reduce(wire, group=state.process_group, async_op=True)
    state.count(sent_bytes=wire.numel() * wire.element_size(), dense_bytes=buffer.numel() * 4)

    def finish(_: object) -> torch.Tensor:
        buffer.copy_(state.codec.decode(Payload(wire, buffer.numel())))
        return buffer

    return work.get_future().then(finish)


def _gathered_reduce(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Encode each parameter of the bucket; one fixed-size all-gather for the whole bucket."""
    buffer = bucket.buffer()
    world_size = state.world_size
    pieces = _names_and_pieces(state, bucket)
    compensated = _compensated(state, pieces)
    finite = all(all_finite(flat) for flat in compensated)
    codecs = _codecs_for_step(state, compensated)
    payloads = [
        codec.encode(flat, generator=state.generator_for(name))
        for codec, flat, (name, _) in zip(codecs, compensated, pieces, strict=True)
    ]
    wire = torch.cat(  # payloads, then the non-finite flag byte (see the module docs)
        [payload.data.contiguous().view(torch.uint8).reshape(-1) for payload in payloads]
        + [torch.tensor([0 if finite else 1], dtype=torch.uint8, device=buffer.device)]
    )
    gathered = torch.empty(world_size * wire.numel(), dtype=torch.uint8, device=buffer.device)
    work = dist.all_gather_into_tensor(gathered, wire, group=state.process_group, async_op=True)
    state.count(sent_bytes=wire.numel(), dense_bytes=buffer.numel() * 4)
    if state.options.error_feedback and finite:  # computed while the all-gather is in flight
        errors = [
            flat - codec.decode(payload)
            for codec, flat, payload in zip(codecs, compensated, payloads, strict=True)
        ]
        _store_residuals(state, pieces, errors)

    def finish(_: object) -> torch.Tensor:
        rows = gathered.view(world_size, -1)
        if bool(rows[:, -1].any()):
            buffer.fill_(float("nan"))
            return buffer
        start = element = 0
        for codec, payload in zip(codecs, payloads, strict=True):
            width = payload.data.numel() * payload.data.element_size()
            # clone: a slice may start at an odd byte offset; codecs view bytes as wider types
            received = [
                Payload(row[start : start + width].clone().view(payload.data.dtype), payload.numel)
                for row in rows
            ]
            total = codec.decode_sum(received)
            buffer[element : element + payload.numel].copy_(total / world_size)
            start, element = start + width, element + payload.numel
        return buffer

    return work.get_future().then(finish)


def _codecs_for_step(state: CompressionState, compensated: list[torch.Tensor]) -> list[Any]:
    """One codec per parameter: this step's θ from the schedule; ErrorBudgetTheta's choices
    are agreed across ranks by one all-reduce MIN per bucket."""
    schedule = state.theta_schedule
    if schedule is None:
        return [state.codec] * len(compensated)
    from superneurons.compress.schedule import with_theta

    if hasattr(schedule, "choose"):
        chosen = [float(schedule.choose(flat, state.codec)) for flat in compensated]
        thetas = torch.tensor(chosen, device=compensated[0].device)
        # MIN: the least aggressive θ keeps every rank within its error budget, and equal θ
        # keeps payload sizes equal for the all-gather.
        dist.all_reduce(thetas, op=dist.ReduceOp.MIN, group=state.process_group)
        values = [float(theta) for theta in thetas.tolist()]
    else:
        values = [float(schedule.theta(state.step))] * len(compensated)
    state.last_theta = values[-1]
    return [with_theta(state.codec, theta) for theta in values]
