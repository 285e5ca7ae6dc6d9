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
    "StrategyFloor",
    "TensorDecision",
    "UnitDecision",
]

# How the LM head + loss runs in chunks (``memory.chunked.headloss`` executes them): recompute
# the logits in backward, or compute the gradient in the forward; PyTorch's chunked op, the
# project's loop, or the loop with the unchunked loss's own kernels (recompute only).
HEAD_MODES: tuple[str, ...] = ("recompute", "grad-in-forward")
IMPLEMENTATIONS: tuple[str, ...] = ("native", "pure", "exact")

# 2: the ``recompute+offload`` action, resident/largest-unit bounds; 3: head and sequence
# chunking, the host optimizer
PLAN_VERSION = 3
_READABLE_VERSIONS = (1, 2, 3)
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
    """

    fqn: str
    action: str
    saved_bytes: int = 0
    segment: int = -1

    def __post_init__(self) -> None:
        _check_action(self.action, f"unit {self.fqn!r}")
        if self.saved_bytes < 0:
            raise ConfigError(f"unit {self.fqn!r}: saved_bytes must be >= 0")
        if self.segment >= 0 and self.action != "recompute":
            raise ConfigError(f"unit {self.fqn!r}: only recompute units can be in a segment")


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
    """

    fqn: str
    chunk_tokens: int
    mode: str = "recompute"
    impl: str = "pure"

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ConfigError(f"head {self.fqn!r}: chunk_tokens must be >= 1")
        if self.mode not in HEAD_MODES:
            raise ConfigError(f"head {self.fqn!r}: mode must be one of {', '.join(HEAD_MODES)}")
        if self.impl not in IMPLEMENTATIONS:
            raise ConfigError(f"head {self.fqn!r}: impl must be one of {IMPLEMENTATIONS}")
        if self.impl == "exact" and self.mode != "recompute":
            raise ConfigError(f"head {self.fqn!r}: impl 'exact' recomputes (mode 'recompute')")


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
        host_optimizer: the optimizer runs on the host: its state and fp32 master weights live
            there, each bucket of gradients goes to the host once ready (after its all-reduce
            under DDP) and the updated parameters come back; no gradient, state or master byte
            stays on the device between buckets.
        grad_buckets: with ``host_optimizer``, the parameter fqns of each gradient bucket in the
            order they are launched (the same on every rank).
        version: format version of this record.
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
    host_optimizer: bool = False
    grad_buckets: tuple[tuple[str, ...], ...] = ()
    peak_at: dict[str, Any] = field(default_factory=dict)
    breakdown: dict[str, int] = field(default_factory=dict)
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
        return asdict(self)

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
            data["grad_buckets"] = tuple(tuple(b) for b in data.get("grad_buckets", ()))
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

    @property
    def floor_over_largest_layer(self) -> float:
        """``min_budget_bytes / (resident_bytes + largest_unit_bytes)``: 1.0 is SuperNeurons'
        bound, a peak down to the largest layer's working set on top of the resident state."""
        return self.min_budget_bytes / max(self.resident_bytes + self.largest_unit_bytes, 1)

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["floor_over_largest_layer"] = self.floor_over_largest_layer
        return body
