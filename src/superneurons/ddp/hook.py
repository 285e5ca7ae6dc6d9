"""Compressed gradient averaging as a DDP communication hook.

``state = register_compression(ddp_model, "fft:theta=0.9,bits=8")`` replaces DDP's fp32
all-reduce by a codec (Wang et al., HPDC'20, and the baselines in ``superneurons.compress``).
It takes ONE object: a codec, ``PowerSGD``, a PyTorch anchor or ``Auto``, inside any wrappers
(``ErrorFeedback(Warmup(TopKCodec(), steps=100))``), or a spec string naming one (a string gets
error feedback by default, see :func:`~superneurons.schemes.compose.with_defaults`):

* summable payloads (identity, fp16, bf16) are divided by the world size, encoded and
  all-reduced; every other codec's fixed-size ``uint8`` payloads are all-gathered and turned
  into the average by one ``codec.decode_sum`` (FFT: summed spectra, one inverse FFT);
* each parameter's gradient is encoded on its own, but a bucket travels in ONE collective.
  NOTE: per parameter, not per bucket, so the result does not depend on DDP's bucket layout,
  which changes after the first step and again after a resume: a resumed run continues bit
  for bit, and ``bucket_cap_mb`` only changes the overlap, never the numbers;
* PowerSGD (``powersgd:rank=4``) runs its two all-reduces (see :mod:`.powersgd`);
* the two-phase quantised all-reduce (``twophase:bits=4``) runs an all-to-all and an
  all-gather whose bytes per rank do not grow with the world size (see :mod:`.twophase`);
  but for the last bucket, the all-gather is issued at the start of the next bucket's hook,
  so the all-to-all travels while autograd computes that bucket;
* PyTorch's own hooks (``dense``, ``torch-fp16``, ``torch-powersgd``) are anchors
  (see :mod:`.torch_hooks`);
* ``auto`` chooses per bucket (see :mod:`.auto`, :mod:`.autorun`); every bucket, whatever its
  routes, is averaged by :func:`~superneurons.ddp.reduce.reduce_bucket`.

Safety rules, all of them learned from PyTorch's own hooks:

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

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from superneurons.codecs.codec import Codec
from superneurons.codecs.powersgd import PowerSGD
from superneurons.codecs.twophase import TwoPhase
from superneurons.compat import all_gather_into_tensor
from superneurons.ddp.bucket import Route, pieces_of
from superneurons.ddp.powersgd import PowerSGDState
from superneurons.ddp.reduce import reduce_bucket
from superneurons.ddp.state import CompressionState
from superneurons.ddp.torch_hooks import as_comm_hook, register_anchor
from superneurons.ddp.twophase_route import flush_twophase
from superneurons.errors import ConfigError
from superneurons.schemes.anchors import TorchDense, TorchFp16, TorchPowerSGD
from superneurons.schemes.auto import Auto
from superneurons.schemes.compose import Compression, Pipeline, defaulted, unwrap
from superneurons.schemes.grammar import parse_spec

__all__ = ["CompressionState", "build_state", "register_compression", "resolve", "state_for"]

logger = logging.getLogger("superneurons.compress")

_TEXT_BYTES = 192  # fixed size of the human-readable part of the config check


def resolve(compression: Compression | str) -> tuple[Compression, Pipeline]:
    """The object ``register_compression`` works with, and its pipeline (unwrapped once,
    which validates it): a spec string is parsed and gets the defaults (error feedback on);
    an object is taken as given."""
    if isinstance(compression, str):
        parsed = parse_spec(compression)
        return defaulted(parsed, unwrap(parsed))
    return compression, unwrap(compression)


def register_compression(
    ddp_model: DistributedDataParallel,
    compression: Compression | str,
    *,
    seed: int = 0,
    process_group: dist.ProcessGroup | None = None,
) -> CompressionState:
    """Compress ``ddp_model``'s gradient averaging with ``compression``.

    Collective: every rank calls it, before the first backward. It all-gathers the
    configuration digest right here (so a mismatch fails before any step, in milliseconds,
    never as a hang inside backward), then registers the comm hook; ``auto`` also measures the
    network and its candidate codecs here.

    Args:
        ddp_model: a ``DistributedDataParallel`` model, before its first backward.
        compression: one object — a codec, ``PowerSGD``, ``TorchDense``/``TorchFp16``/
            ``TorchPowerSGD``, ``Auto``, or wrappers around one (``ErrorFeedback``, ``Warmup``,
            ``Scheduled``, ``RowSparse``) — or a spec string (``"fft:theta=0.9,bits=8"``,
            ``"ef(warmup(steps=100,topk))"``, ``"auto"``), which gets error feedback by default.
        seed: seeds stochastic codecs (one generator per rank, step and parameter name)
            and PowerSGD's first ``Q`` (the same on every rank).
        process_group: the group to average over (default: the world).

    Returns:
        The :class:`CompressionState` (counters, ``state_dict``/``load_state_dict``).

    Raises:
        ConfigError: a bad compression, or ranks configured differently (raised on every rank).
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise ConfigError(
            f"register_compression needs a DistributedDataParallel model, got "
            f"{type(ddp_model).__name__}; wrap it first: DistributedDataParallel(model)"
        )
    if not dist.is_initialized():
        raise ConfigError("torch.distributed is not initialised; call init_process_group first")
    module = ddp_model.module
    state = build_state(module, compression, process_group=process_group, seed=seed)
    check_config_across_ranks(module, state)
    base = state.pipeline.base
    if isinstance(base, (TorchDense, TorchFp16, TorchPowerSGD)):
        register_anchor(ddp_model, state)
    else:
        if state.auto is not None:
            state.auto.attach(ddp_model, state)
        ddp_model.register_comm_hook(state, as_comm_hook(compression_hook))
    logger.info("rank %d: compressing gradients with %s", state.rank, state.spec)
    return state


def build_state(
    module: torch.nn.Module,
    compression: Compression | str,
    *,
    process_group: dist.ProcessGroup | None = None,
    seed: int = 0,
) -> CompressionState:
    """The hook's :class:`CompressionState` for ``module`` (the model DDP wraps); needs an
    initialised process group. Local: no collective."""
    return state_for(module, *resolve(compression), process_group=process_group, seed=seed)


def state_for(
    module: torch.nn.Module,
    compression: Compression,
    pipeline: Pipeline,
    *,
    process_group: dist.ProcessGroup | None = None,
    seed: int = 0,
) -> CompressionState:
    """:func:`build_state` of a resolved ``compression`` and its ``pipeline``."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    embeddings = frozenset(
        f"{name}.weight" if name else "weight"
        for name, sub in module.named_modules()
        if isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag))
    )
    state = CompressionState(
        compression=compression,
        pipeline=pipeline,
        process_group=process_group,
        world_size=dist.get_world_size(process_group),
        rank=dist.get_rank(process_group),
        names_by_param={id(p): name for name, p in module.named_parameters()},
        seed=seed,
        embedding_names=embeddings if pipeline.row_sparse else frozenset(),
        powersgd=PowerSGDState(seed=seed) if isinstance(pipeline.base, PowerSGD) else None,
    )
    if isinstance(pipeline.base, Auto):
        from superneurons.ddp.autorun import AutoController

        state.auto = AutoController(pipeline.base, error_feedback=pipeline.error_feedback)
    return state


def check_config_across_ranks(module: torch.nn.Module, state: CompressionState) -> None:
    """All-gather a fixed-size digest of the configuration; raise on every rank if they differ."""
    world_size, group = state.world_size, state.process_group
    params = [(n, list(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    described = {"spec": state.spec, "seed": state.seed, "world_size": world_size}
    described["params"] = params  # type: ignore[assignment]
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).digest()
    text = f"{state.spec} seed={state.seed} params={len(params)}"
    raw = digest + text.encode()[:_TEXT_BYTES].ljust(_TEXT_BYTES, b"\0")
    # NOTE: on the parameters' device: NCCL only moves CUDA tensors.
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    gathered = torch.empty(world_size * mine.numel(), dtype=torch.uint8, device=device)
    all_gather_into_tensor(gathered, mine, group=group)
    rows = gathered.view(world_size, -1).cpu()
    differing = [r for r in range(world_size) if not torch.equal(rows[r], rows[0])]
    if differing:
        described_ranks = "; ".join(f"rank {r}: {_text(rows[r, 32:])}" for r in [0, *differing])
        raise ConfigError(
            "ranks are configured differently (compression, seed, world size or model "
            f"parameters): {described_ranks}; launch every rank with the same settings"
        )


def _text(row: torch.Tensor) -> str:
    return bytes(row.tolist()).rstrip(b"\0").decode(errors="replace")


def compression_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The DDP comm hook: one bucket in, the averaged bucket out (see the module docs)."""
    flush_twophase(state)  # the previous bucket's second phase first: a fixed order
    if bucket.index() == 0:
        state.begin_step()
    pipeline = state.pipeline
    n = len(bucket.parameters())
    codecs_for_step = None
    routes: list[Route]
    if state.auto is not None:
        routes = state.auto.routes(state, bucket)
    elif state.step < pipeline.warmup_steps:
        routes = [None] * n
    else:
        base = pipeline.base
        assert isinstance(base, (PowerSGD, TwoPhase, Codec))
        routes = [base] * n
        if pipeline.schedule is not None and isinstance(base, Codec) and not base.summable:
            codecs_for_step = _codecs_for_step(state, pipeline, base, bucket)
    fut = reduce_bucket(state, bucket, routes, codecs_for_step=codecs_for_step)
    if state.auto is not None:
        fut = state.auto.after_reduce(state, bucket, fut)
    if bucket.is_last():
        state.end_step()
    return fut


def _codecs_for_step(
    state: CompressionState, pipeline: Pipeline, codec: Codec, bucket: dist.GradBucket
) -> list[Codec]:
    """One codec per parameter: this step's θ from the schedule; ErrorBudgetTheta's choices
    are agreed across ranks by one all-reduce MIN per bucket."""
    from superneurons.codecs.schedule import ErrorBudgetTheta, with_theta

    schedule = pipeline.schedule
    pieces = pieces_of(state.names_by_param, bucket)
    if isinstance(schedule, ErrorBudgetTheta):
        chosen = []
        for piece in pieces:
            flat = piece.flat.float()
            residual = state.residuals.get(piece.name) if pipeline.error_feedback else None
            chosen.append(
                float(schedule.choose(flat + residual if residual is not None else flat, codec))
            )
        thetas = torch.tensor(chosen, device=bucket.buffer().device)
        # MIN: the least aggressive θ keeps every rank within its error budget, and equal θ
        # keeps payload sizes equal for the all-gather.
        dist.all_reduce(thetas, op=dist.ReduceOp.MIN, group=state.process_group)
        values = [float(theta) for theta in thetas.tolist()]
    else:
        assert schedule is not None
        values = [float(schedule.theta(state.step))] * len(pieces)
    state.last_theta = values[-1]
    return [with_theta(codec, theta) for theta in values]
