"""A memory Plan: per unit keep / offload / recompute, with its predicted cost.

A *unit* is a module (e.g. a residual block, a stem layer, the LM head) whose saved activations
are treated together (docs/CONTRACTS.md). ``keep`` leaves them on the device (eager PyTorch);
``offload`` sends every saved non-parameter tensor packed during the unit's forward to the host
pool and prefetches it for backward (SuperNeurons' Unified Tensor Pool, Wang et al., PPoPP'18
§3.2); ``recompute`` runs the unit under non-reentrant checkpoint so only its inputs stay saved
(cost-aware recomputation, ibid. §3.3; Chen et al. 2016); ``recompute+offload`` does both, as
SuperNeurons does: the unit is recomputed in backward and its *checkpoint* (the input the
checkpoint saves) lives in the host pool between forward and a prefetch one unit ahead, so
nothing of the unit stays on the device.

Below the largest layer (the language-model case): ``head`` evaluates the LM head and its loss
in chunks of tokens (:mod:`superneurons.memory.chunked.headloss`), ``seq_chunks`` runs position-wise
sub-layers (a block's MLP) over chunks of the sequence under recomputation, and
``host_optimizer`` keeps the optimizer (state, fp32 master weights, its step) on the host,
stepping bucket by bucket as gradients are ready
(:mod:`superneurons.memory.offload.host_optimizer`).

A Plan is frozen data with a ``version`` and a JSON round trip, so the runtime (another
process, another machine) can execute a plan made here. It is made by
:func:`superneurons.memory.planner.decide.make_plan` (this module imports nothing from the planner).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from superneurons.errors import ConfigError

__all__ = [
    "ACTIONS",
    "HEAD_MODES",
    "IMPLEMENTATIONS",
    "PLAN_VERSION",
    "SEARCH_STRATEGIES",
    "SINGLE_DEVICE_STRATEGIES",
    "STRATEGIES",
    "HeadChunking",
    "InfeasibleBudgetError",
    "Plan",
    "SeqChunking",
    "mlp_pieces",
    "StrategyFloor",
    "TensorDecision",
    "TrainingStep",
    "UnitDecision",
    "WEIGHTS",
]

# How the LM head + loss runs in chunks (``memory.chunked.headloss`` executes them): recompute
# the logits in backward, or compute the gradient in the forward; PyTorch's chunked op, the
# project's loop, or the loop with the unchunked loss's own kernels (recompute only).
HEAD_MODES: tuple[str, ...] = ("recompute", "grad-in-forward")
IMPLEMENTATIONS: tuple[str, ...] = ("native", "pure", "exact")

# 2: the ``recompute+offload`` action, resident/largest-unit bounds; 3: head and sequence
# chunking, the host optimizer; 4: per-unit weights on the device or streamed from the host
PLAN_VERSION = 4
_READABLE_VERSIONS = (1, 2, 3, 4)
# Where a unit's parameters live between its uses: resident on the device, or in the host pool
# with a device copy only around the unit's forward and its backward (``memory.offload.weights``)
WEIGHTS: tuple[str, ...] = ("device", "host")
ACTIONS: tuple[str, ...] = ("keep", "offload", "recompute", "recompute+offload")
RECOMPUTING: frozenset[str] = frozenset({"recompute", "recompute+offload"})
OFFLOADING: frozenset[str] = frozenset({"offload", "recompute+offload"})
STRATEGIES: tuple[str, ...] = (
    "eager",
    "checkpoint",
    "recompute",
    "offload",
    "offload+opt-in-backward",
    "offload+opt-on-host",
    "offload+host-optimizer",
    "stream-weights",
    "auto",
)
# Every concrete strategy: what ``plan`` reports, ``plan --max-*`` and ``bench deeper`` search.
SEARCH_STRATEGIES: tuple[str, ...] = tuple(s for s in STRATEGIES if s != "auto")
# Strategies that step the optimizer inside backward, before DDP's all-reduce: one device only.
SINGLE_DEVICE_STRATEGIES: frozenset[str] = frozenset(
    {"offload+opt-in-backward", "offload+opt-on-host"}
)


class InfeasibleBudgetError(ConfigError):
    """The budget is below the minimum the strategy asked for reaches; the message names that
    minimum (``min_budget_bytes``, which the same call with that budget plans at) and the
    concrete ``strategy`` reaching it."""

    def __init__(self, message: str, *, min_budget_bytes: int, strategy: str) -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes
        self.strategy = strategy


def _check_action(action: str, where: str) -> None:
    if action not in ACTIONS:
        raise ConfigError(f"{where}: action {action!r} is not one of {', '.join(ACTIONS)}")


@dataclass(frozen=True)
class UnitDecision:
    """What to do with one unit's saved activations.

    Attributes:
        fqn: fully qualified module name of the unit (``model.get_submodule(fqn)``).
        action: one of :data:`ACTIONS`.
        saved_bytes: bytes of saved activations the unit holds under ``keep`` (storage-deduped).
        segment: -1, or the id of a *segment*: consecutive children of one ``nn.Sequential``, all
            ``recompute``, that also run together under one outer non-reentrant checkpoint
            (nested around their own), so only the segment's input stays saved between forward
            and backward (memory-centric recomputation, SuperNeurons §3.3; Chen et al. 2016's
            sqrt(n) segments). Optional: a runtime that ignores it is correct, just uses more
            memory than predicted.
        weights: ``"device"`` (its parameters stay resident) or ``"host"``: they live in the
            host pool and are copied to the device ahead of the unit's forward and again ahead
            of its backward, one unit ahead on a side stream, and released after each
            (:mod:`superneurons.memory.offload.weights`; version 4).
    """

    fqn: str
    action: str
    saved_bytes: int = 0
    segment: int = -1
    weights: str = "device"

    def __post_init__(self) -> None:
        _check_action(self.action, f"unit {self.fqn!r}")
        if self.saved_bytes < 0:
            raise ConfigError(f"unit {self.fqn!r}: saved_bytes must be >= 0")
        if self.segment >= 0 and self.action != "recompute":
            raise ConfigError(f"unit {self.fqn!r}: only recompute units can be in a segment")
        if self.weights not in WEIGHTS:
            raise ConfigError(
                f"unit {self.fqn!r}: weights {self.weights!r} is not one of {', '.join(WEIGHTS)}"
            )


@dataclass(frozen=True)
class HeadChunking:
    """The LM head and its loss evaluated ``chunk_tokens`` tokens at a time.

    Attributes:
        fqn: the output embedding (a Hugging Face causal LM's ``get_output_embeddings()``, the
            zoo GPT's ``lm_head``); its parent module is the model called with the labels.
        chunk_tokens: tokens per chunk (``headloss.chunk_tokens_for``).
        mode: ``"recompute"`` (logits recomputed in backward) or ``"grad-in-forward"``.
        impl: ``"native"`` (PyTorch's ``F.linear_cross_entropy``), ``"pure"`` or ``"exact"``
            (``recompute`` only: the hidden states' gradients bit for bit those of the
            unchunked loss): the one the plan was profiled with.
        vocab_rows: 0, or rows of the output embedding's weight per *vocabulary slice*: the
            loss runs over slices ``W[v0:v1]`` with an online log-sum-exp, recomputing each
            slice's logits in backward (``memory.chunked.vocab``; mode ``recompute``, impl
            ``pure``), so a head whose unit streams its weights (``weights="host"``) fetches
            one slice at a time and writes each slice's gradient to the host. Written to JSON
            only when set (older builds read the rest).
    """

    fqn: str
    chunk_tokens: int
    mode: str = "recompute"
    impl: str = "pure"
    vocab_rows: int = 0

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ConfigError(f"head {self.fqn!r}: chunk_tokens must be >= 1")
        if self.mode not in HEAD_MODES:
            raise ConfigError(f"head {self.fqn!r}: mode must be one of {', '.join(HEAD_MODES)}")
        if self.impl not in IMPLEMENTATIONS:
            raise ConfigError(f"head {self.fqn!r}: impl must be one of {IMPLEMENTATIONS}")
        if self.impl == "exact" and self.mode != "recompute":
            raise ConfigError(f"head {self.fqn!r}: impl 'exact' recomputes (mode 'recompute')")
        if self.vocab_rows < 0:
            raise ConfigError(f"head {self.fqn!r}: vocab_rows must be >= 0 (0: no slices)")
        if self.vocab_rows and (self.mode, self.impl) != ("recompute", "pure"):
            raise ConfigError(
                f"head {self.fqn!r}: vocabulary slices recompute their logits in the project's "
                "loop: use mode 'recompute' and impl 'pure' with vocab_rows"
            )


@dataclass(frozen=True)
class SeqChunking:
    """A position-wise sub-layer (a transformer block's MLP) run over ``chunks`` pieces of the
    sequence, each under its own non-reentrant checkpoint, so its intermediates exist for one
    piece at a time (memory-centric recomputation, SuperNeurons §3.3)."""

    fqn: str
    chunks: int

    def __post_init__(self) -> None:
        if self.chunks < 2:
            raise ConfigError(f"{self.fqn!r}: a sequence split needs >= 2 chunks")


def mlp_pieces(splits: Sequence[SeqChunking]) -> int:
    """The most pieces any block MLP of ``splits`` runs in (1: none split; norms not counted)."""
    return max((c.chunks for c in splits if c.fqn.rsplit(".", 1)[-1] == "mlp"), default=1)


@dataclass(frozen=True)
class TensorDecision:
    """The action a plan implies for one saved tensor of the profile.

    Attributes:
        key: the profile's stable key ``"<fqn>#<call>:<ordinal>"``.
        unit: fqn of the unit it belongs to (``""``: outside every unit, always kept).
        action: ``"keep"``, ``"offload"`` or ``"recompute"``.
        nbytes: its storage bytes (0 if the storage was already counted for another key).
    """

    key: str
    unit: str
    action: str
    nbytes: int = 0

    def __post_init__(self) -> None:
        _check_action(self.action, f"tensor {self.key!r}")


# what a version 3 record lacks (Plan.to_dict leaves them out of one)
_VERSION_4_KEYS = (
    "weights_host_bytes",
    "streamed_bytes",
    "weights_exposed_s",
    "exposed_transfer_s",
)


@dataclass(frozen=True)
class TrainingStep:
    """What the training loop does around the optimizer step: where a plan may step it, and
    what the step holds (the planner counts it; the runtime follows it).

    Attributes:
        max_grad_norm: the loop clips the gradients to this global norm before each step
            (``torch.nn.utils.clip_grad_norm_``, HF's ``max_grad_norm``); 0: no clipping. An
            optimizer off the device cannot step a parameter before every gradient of the step
            exists: its step waits for the global norm (after backward, not beside it).
        norm_type: the p of that norm (2.0; ``inf`` allowed).
        accumulation_steps: micro-batches whose gradients are summed before one optimizer step
            (HF's ``gradient_accumulation_steps``): the sum lives through the micro-batches, on
            the device (eager, recompute, offload, optimizer-in-backward) or in host buffers
            (the host optimizer).
    """

    max_grad_norm: float = 0.0
    norm_type: float = 2.0
    accumulation_steps: int = 1

    def __post_init__(self) -> None:
        if not self.max_grad_norm >= 0:  # NaN fails too
            raise ConfigError(
                f"max_grad_norm must be >= 0 (0: no clipping), got {self.max_grad_norm}"
            )
        if not self.norm_type > 0:
            raise ConfigError(f"norm_type must be > 0, got {self.norm_type}")
        steps = self.accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"accumulation_steps must be an int >= 1, got {steps!r}")

    @property
    def clips(self) -> bool:
        return self.max_grad_norm > 0

    @property
    def waits(self) -> bool:
        """An optimizer stepped as gradients arrive must wait instead: for the global norm, or
        for the last micro-batch."""
        return self.clips or self.accumulation_steps > 1


@dataclass(frozen=True)
class Plan:
    """Per-unit decisions plus predictions. Build with ``make_plan``; execute with ``apply_plan``.

    Attributes:
        units: one decision per unit, in forward order.
        strategy: the strategy that produced it (one of :data:`STRATEGIES`; ``auto`` is resolved
            to the strategy it chose).
        budget_bytes: the device byte budget it was made for.
        optimizer_in_backward: step each parameter as soon as its gradient is accumulated and
            free the gradient (``Tensor.register_post_accumulate_grad_hook``).
        optimizer_on_host: with ``optimizer_in_backward``, keep the optimizer state in the host
            pool between the parameters' steps (ZeRO-Offload's placement; fetched one parameter
            ahead in backward, sent back after the step: ``memory.offload.optim_host``).
        optimizer_host_bytes: optimizer-state bytes in the host pool (0 unless on host).
        optimizer_copy_s: predicted copy time of that state per step (both directions).
        predicted_peak_bytes: predicted device peak of one training step under the plan.
        peak_at: where that peak is: ``{"unit", "phase", "event"}``
            (:func:`superneurons.memory.planner.where.locate`).
        breakdown: the live bytes at that peak by what they are
            (:data:`superneurons.memory.planner.predict.BREAKDOWN`); they sum to the peak.
        min_budget_bytes: the smallest budget the strategy asked for reaches on this profile
            (``auto``: the least over the strategies it may take): the same call plans at it.
        host_bytes: predicted pinned host bytes for offloaded activations.
        extra_compute_s: predicted recompute time per step.
        transfer_s: predicted host<->device copy time per step (both directions).
        feasible: ``predicted_peak_bytes <= budget_bytes``.
        tensors: the implied action of every saved tensor.
        resident_bytes: parameters + gradients + optimizer state of the step (steady state).
        largest_unit_bytes: the largest working set of one unit's (or the loss's) forward +
            backward; ``resident_bytes + largest_unit_bytes`` is the largest-layer bound.
        head: the LM head + loss in chunks (None: as the model computes it).
        seq_chunks: sub-layers run over pieces of the sequence.
        adapter_inputs: fqns of PEFT LoRA layers whose adapters keep their input at the base's
            precision (:mod:`superneurons.memory.chunked.adapter_inputs`); ``to_dict`` leaves
            the key out when empty.
        host_optimizer: the optimizer runs on the host: its state and fp32 master weights live
            there, each bucket of gradients goes to the host once ready (after its all-reduce
            under DDP) and the updated parameters come back; no gradient, state or master byte
            stays on the device between buckets.
        grad_buckets: with ``host_optimizer``, the parameter fqns of each gradient bucket in the
            order they are launched (the same on every rank).
        step: the training step the plan was made for (clipping, accumulation); None: one
            backward per step, no clipping. ``to_dict`` leaves the key out when None.
        weights_host_bytes: pinned host bytes of the streamed units' parameters (their host
            copies; the host optimizer's fp32 masters are ``optimizer_host_bytes``).
        streamed_bytes: weight bytes copied host -> device per step (each streamed parameter
            twice: ahead of its unit's forward and of its backward; once for a unit whose
            backward reads none of its weights, an embedding that is not recomputed).
        weights_exposed_s: predicted time per step the weight copies add beyond the compute
            they overlap (the device preset's host link).
        exposed_transfer_s: predicted time per step all the plan's copies (activations,
            optimizer, weights) add beyond the compute they overlap; a prediction, not part of
            the plan's identity (not compared, and absent from a version 3 record).
        version: format version of this record: the oldest that holds it (a plan that streams
            no weights is written as version 3, which older builds read).
    """

    units: tuple[UnitDecision, ...]
    strategy: str
    budget_bytes: int
    optimizer_in_backward: bool = False
    predicted_peak_bytes: int = 0
    min_budget_bytes: int = 0
    host_bytes: int = 0
    extra_compute_s: float = 0.0
    transfer_s: float = 0.0
    feasible: bool = True
    tensors: tuple[TensorDecision, ...] = field(default=())
    resident_bytes: int = 0
    largest_unit_bytes: int = 0
    optimizer_on_host: bool = False
    optimizer_host_bytes: int = 0
    optimizer_copy_s: float = 0.0
    head: HeadChunking | None = None
    seq_chunks: tuple[SeqChunking, ...] = ()
    adapter_inputs: tuple[str, ...] = ()
    host_optimizer: bool = False
    grad_buckets: tuple[tuple[str, ...], ...] = ()
    peak_at: dict[str, Any] = field(default_factory=dict)
    breakdown: dict[str, int] = field(default_factory=dict)
    weights_host_bytes: int = 0
    streamed_bytes: int = 0
    weights_exposed_s: float = 0.0
    exposed_transfer_s: float = field(default=0.0, compare=False)
    step: TrainingStep | None = None
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"unknown strategy {self.strategy!r}: use one of {', '.join(STRATEGIES)}"
            )
        if self.budget_bytes <= 0:
            raise ConfigError(f"budget_bytes must be positive, got {self.budget_bytes}")
        if self.version not in _READABLE_VERSIONS:
            raise ConfigError(
                f"plan version {self.version} is not supported (this build reads "
                f"version {PLAN_VERSION}): re-create the plan with `superneurons plan`"
            )
        if self.optimizer_on_host and not self.optimizer_in_backward:
            raise ConfigError(
                "optimizer_on_host needs optimizer_in_backward: the host state is fetched in "
                "each parameter's gradient hook"
            )
        if self.host_optimizer and self.optimizer_in_backward:
            raise ConfigError(
                "host_optimizer and optimizer_in_backward exclude each other: the host optimizer "
                "steps each bucket itself"
            )
        fqns = [u.fqn for u in self.units]
        if len(set(fqns)) != len(fqns):
            raise ConfigError("a plan lists each unit once; duplicate unit fqns found")
        if self.streams_weights and self.version < 4:
            raise ConfigError("units with weights='host' need a version 4 plan")
        if self.streams_weights and self.optimizer_in_backward:
            raise ConfigError(
                "streamed weights take the host optimizer (host_optimizer=True), not "
                "optimizer_in_backward: the host step updates the host copy the next fetch carries"
            )

    @property
    def streams_weights(self) -> bool:
        """Some unit's parameters live in the host pool (``weights="host"``)."""
        return any(u.weights == "host" for u in self.units)

    def streamed_units(self) -> list[str]:
        """The fqns of the units whose weights stream, in plan (forward) order."""
        return [u.fqn for u in self.units if u.weights == "host"]

    def action_of(self, fqn: str) -> str:
        """The action for unit ``fqn`` (``"keep"`` for modules that are not units)."""
        for unit in self.units:
            if unit.fqn == fqn:
                return unit.action
        return "keep"

    def count(self, action: str) -> int:
        """How many units get ``action``."""
        return sum(1 for u in self.units if u.action == action)

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        if self.step is None:  # a plan made for the plain step reads as it always has
            del body["step"]
        if self.head is not None and not self.head.vocab_rows:
            del body["head"]["vocab_rows"]  # a head without slices reads as it always has
        if not self.adapter_inputs:
            del body["adapter_inputs"]  # nor does a plan that keeps no adapter input
        if self.version < 4:  # the version 3 record, key for key
            for unit in body["units"]:
                del unit["weights"]
            for key in _VERSION_4_KEYS:
                del body[key]
        return body

    @property
    def training_step(self) -> TrainingStep:
        """:attr:`step`, or the plain step (no clipping, no accumulation)."""
        return self.step if self.step is not None else TrainingStep()

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> Plan:
        try:
            data = dict(body)
            data["units"] = tuple(UnitDecision(**u) for u in data["units"])
            data["tensors"] = tuple(TensorDecision(**t) for t in data.get("tensors", ()))
            if data.get("head") is not None:
                data["head"] = HeadChunking(**data["head"])
            data["seq_chunks"] = tuple(SeqChunking(**c) for c in data.get("seq_chunks", ()))
            data["adapter_inputs"] = tuple(data.get("adapter_inputs", ()))
            data["grad_buckets"] = tuple(tuple(b) for b in data.get("grad_buckets", ()))
            if data.get("step") is not None:
                data["step"] = TrainingStep(**data["step"])
            return cls(**data)
        except (KeyError, TypeError) as exc:
            raise ConfigError(
                f"not a superneurons plan ({exc}): write one with Plan.to_json"
            ) from exc

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"plan JSON does not parse: {exc}") from exc
        if not isinstance(body, dict):
            raise ConfigError("plan JSON must be an object: write one with Plan.to_json")
        return cls.from_dict(body)


@dataclass(frozen=True)
class StrategyFloor:
    """The smallest peak one strategy reaches on a profile, and what it is made of.

    What ``plan --json`` reports per strategy (docs/CONTRACTS.md). ``resident_bytes`` is the
    strategy's own: parameters, gradients unless the optimizer steps in backward (then each
    gradient is freed at once), optimizer state unless it lives in the host pool.
    ``predicted_overhead_s`` is extra compute plus exposed transfers per step (cost model).
    """

    strategy: str
    min_budget_bytes: int
    eager_peak_bytes: int
    resident_bytes: int
    largest_unit_bytes: int
    host_bytes: int
    predicted_overhead_s: float
    peak_at: dict[str, Any]
    breakdown: dict[str, int]
    supports_ddp: bool
    optimizer_on_host: bool = False
    optimizer_host_bytes: int = 0
    # the profile the floor was reached on: the LM head + loss working set (``bounds.
    # head_loss_bytes``), its chunk (tokens; None: unchunked) and the pieces of the block MLPs
    head_loss_working_set_bytes: int = 0
    head_chunk_tokens: int | None = None
    mlp_pieces: int = 1
    # streamed weights (``stream-weights``): bytes copied host -> device per step, the pinned
    # host bytes of those weights; for every strategy the copies' time no compute hides
    # (activations, optimizer, weights; the cost model's host link) and all the pinned host
    # memory the plan needs (activations + optimizer state and masters + weights)
    streamed_bytes: int = 0
    weights_host_bytes: int = 0
    exposed_transfer_s: float = 0.0
    pinned_host_bytes: int = 0

    @property
    def floor_over_largest_layer(self) -> float:
        """``min_budget_bytes / (resident_bytes + largest_unit_bytes)``: 1.0 is SuperNeurons'
        bound, a peak down to the largest layer's working set on top of the resident state."""
        return self.min_budget_bytes / max(self.resident_bytes + self.largest_unit_bytes, 1)

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["floor_over_largest_layer"] = self.floor_over_largest_layer
        return body
