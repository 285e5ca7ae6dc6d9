"""Profile a Hugging Face causal LM's training step from its configuration: no weights, ever.

``superneurons plan --model hf:NAME_OR_PATH`` asks "what fits" for a language model before anyone
downloads it. :func:`profile_causal_lm` builds the model from a ``transformers`` configuration
under ``FakeTensorMode`` (parameters, optimizer state and activations carry shapes and dtypes, no
storage: the Llama-3-8B shape builds in seconds in a few hundred MiB) and profiles the step as
people write it (:class:`LMStep`)::

    with torch.autocast(device, dtype=torch.bfloat16):  # --autocast bf16 (optional)
        outputs = model(input_ids=ids, labels=ids)        # HF's shift + cross-entropy inside
    outputs.loss.backward()                               # outputs kept (the no_trainer loop)
    optimizer.step()                                      # foreach on CUDA, as torch defaults

What the target device runs, modelled on fake *cpu* tensors:

* **attention**: HF's ``sdpa`` path calls scaled-dot-product attention (``is_causal=True`` with
  no padding mask, ``enable_gqa`` for grouped heads). On CUDA it runs a fused kernel: flash
  (bf16/fp16, no mask), memory-efficient (also fp32, masks) or cuDNN, all accepting grouped heads
  and dropout (torch 2.13 ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``); each saves
  the output and one fp32 log-sum-exp per query and head, no ``T x T`` scores. For a CUDA target
  the profile runs ``_scaled_dot_product_flash_attention_for_cpu`` in its place, which saves
  exactly those (:class:`FusedAttention`; dropout's random state is a few bytes there). For a
  cpu target the cpu dispatch decides, as it would: flash without dropout, the math path (with
  its ``T x T`` scores and dropout mask) with it (GPT-2's ``attn_pdrop``). The ops seen are
  reported (:func:`attention_ops`).
* **the optimizer**: ``torch.optim`` picks ``foreach`` for CUDA tensors and the single-tensor
  loop for cpu ones (``torch/optim/optimizer.py``, ``_default_to_fused_or_foreach``); fake
  tensors would get the single-tensor loop, so the implementation is passed explicitly. AdamW's
  ``foreach`` step holds a copy of ``exp_avg_sq`` (its square root) for every parameter at once:
  for Llama-3-8B in bf16, 14.96 GiB the single-tensor loop never holds.
* **autocast**: cpu autocast on fake cpu tensors. For the shipped architectures (linear layers,
  SDPA, RMSNorm/LayerNorm on an fp32 residual stream, HF's loss on ``logits.float()``) the op
  dtypes equal CUDA autocast's; a model whose softmax or layer norm runs on bf16 inputs would
  differ (CUDA autocast runs those in fp32).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from superneurons.errors import ConfigError
from superneurons.memory.profile_types import Profile, default_units
from superneurons.memory.profiling.step import output_loss, profile_step
from superneurons.memory.sizing.adapted import adapt
from superneurons.memory.sizing.adapters import LoraSpec, QuantSpec

__all__ = [
    "DTYPES",
    "FusedAttention",
    "LMStep",
    "OPTIMIZER_IMPLS",
    "BELOW_FLOOR",
    "attention_ops",
    "default_optimizer_impl",
    "load_config",
    "max_positions",
    "profile_causal_lm",
    "profile_causal_lm_below",
    "require_rotary_positions",
    "rotary_positions",
]

logger = logging.getLogger("superneurons.memory")

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPTIMIZER_IMPLS: tuple[str, ...] = ("single", "foreach", "fused")
TARGET_DEVICES: tuple[str, ...] = ("cuda", "cpu")
LM_OPTIMIZERS: tuple[str, ...] = ("adamw", "sgd", "none")
# below the largest layer, the floor only: the head + loss in chunks and the block MLPs split
BELOW_FLOOR: tuple[str, ...] = ("recompute+split",)


@dataclass(frozen=True)
class LMStep:
    """One training step of a causal LM, as the user's loop runs it.

    Attributes:
        seq_len / batch_size: the batch ``(batch_size, seq_len)`` of token ids (labels = ids).
        dtype: parameter dtype, ``"fp32"`` or ``"bf16"``.
        autocast: ``None`` or ``"bf16"``: forward + loss under autocast, backward and step out.
        optimizer: ``"adamw"`` (lr 1e-4), ``"sgd"`` (momentum 0.9) or ``"none"``.
        optimizer_impl: ``"single"``, ``"foreach"`` or ``"fused"`` (:func:`default_optimizer_impl`).
        keep_outputs: the loop keeps ``outputs`` (the logits) alive through backward.
        target_device: ``"cuda"`` or ``"cpu"``: whose kernels and defaults are modelled.
        lora: LoRA adapters train and the base is frozen (None: a full fine-tune); the
            optimizer steps the adapters only (:mod:`.adapted`).
        quantize: the frozen linear layers at bitsandbytes' storage (needs ``lora``).
    """

    seq_len: int
    batch_size: int = 1
    dtype: str = "fp32"
    autocast: str | None = None
    optimizer: str = "adamw"
    optimizer_impl: str = "foreach"
    keep_outputs: bool = True
    target_device: str = "cuda"
    lora: LoraSpec | None = None
    quantize: QuantSpec | None = None

    def __post_init__(self) -> None:
        if self.seq_len < 1 or self.batch_size < 1:
            raise ConfigError(
                f"seq_len and batch_size must be >= 1, got {self.seq_len} and {self.batch_size}"
            )
        _one_of("dtype", self.dtype, tuple(DTYPES))
        if self.autocast is not None:
            _one_of("autocast", self.autocast, ("bf16",))
            if self.dtype != "fp32":
                raise ConfigError("autocast applies to fp32 parameters: use --dtype fp32")
        _one_of("optimizer", self.optimizer, LM_OPTIMIZERS)
        _one_of("optimizer_impl", self.optimizer_impl, OPTIMIZER_IMPLS)
        _one_of("target_device", self.target_device, TARGET_DEVICES)
        if self.quantize is not None and self.lora is None:
            raise ConfigError(
                "--quantize needs --lora: quantized weights are frozen, only adapters train"
            )


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def default_optimizer_impl(target_device: str) -> str:
    """What ``torch.optim`` runs by default for tensors on ``target_device``: ``foreach`` where
    torch has foreach kernels for the device (cuda), else ``single``."""
    from torch.optim.optimizer import _get_foreach_kernels_supported_devices

    return "foreach" if target_device in _get_foreach_kernels_supported_devices() else "single"


def load_config(name_or_path: str) -> tuple[Any, str]:
    """``(transformers config, source)`` for a shipped name (``models.hf_configs``) or a path to
    a ``config.json`` (or a directory holding one).

    Raises:
        ConfigError: an unknown name, or a file ``transformers.AutoConfig`` cannot read.
    """
    transformers = _transformers()
    from superneurons.models.hf_configs import HF_CONFIGS

    if name_or_path in HF_CONFIGS:
        shipped = HF_CONFIGS[name_or_path]
        fields = dict(shipped.config)
        return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields), shipped.source
    path = Path(name_or_path)
    if not path.exists():
        raise ConfigError(
            f"hf:{name_or_path} is neither a shipped configuration ({', '.join(HF_CONFIGS)}) "
            "nor a path to a config.json"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"hf:{name_or_path}: transformers cannot read it ({first})") from exc
    return config, str(path.resolve())


def max_positions(config: Any) -> int | None:
    """The longest sequence the configuration's position embeddings cover (None: unbounded)."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


def rotary_positions(config: Any) -> bool:
    """Whether the configuration computes its positions (rotary embeddings: Llama, Qwen,
    Mistral, ...) rather than looking them up in a table of ``max_position_embeddings`` rows
    (GPT-2's ``wpe``): only then can a longer sequence run at all (how well it is modelled
    past the positions trained is the rotary scaling's matter, never memory's)."""
    fields = ("rope_parameters", "rope_theta", "rope_scaling", "rotary_dim", "rotary_pct")
    return any(getattr(config, name, None) is not None for name in fields)


def require_rotary_positions(config: Any) -> None:
    """Raise :class:`ConfigError` for ``--beyond-positions`` unless :func:`rotary_positions`."""
    if not rotary_positions(config):
        raise ConfigError(
            "--beyond-positions: this configuration looks its positions up in a table of "
            f"{max_positions(config)} rows; a longer sequence cannot run at all"
        )


def profile_causal_lm(config: Any, step: LMStep, *, units: list[str] | None = None) -> Profile:
    """Profile one step of ``AutoModelForCausalLM.from_config(config)`` on fake tensors.

    Units: the decoder layers, the embeddings, the final norm and the LM head
    (:func:`~superneurons.memory.profile_types.default_units`), unless ``units`` names others.

    Raises:
        ConfigError: ``seq_len`` beyond the configuration's positions, an architecture that is
            not a causal LM, or a step that fails under fake tensors.
    """
    return profile_causal_lm_below(config, step, units=units, variants=())[0]


def profile_causal_lm_below(
    config: Any,
    step: LMStep,
    *,
    units: list[str] | None = None,
    variants: tuple[str, ...] = BELOW_FLOOR,
    check_positions: bool = True,
    progress: Callable[[str], None] | None = None,
) -> tuple[Profile, list[Profile]]:
    """The plain profile of :func:`profile_causal_lm` and the profiles of the same step below
    the largest layer (:func:`superneurons.memory.profiling.below.below_profiles`: the LM head +
    loss in
    chunks, each block's MLP over pieces of the sequence), one model built once. ``variants``:
    which of :data:`superneurons.memory.profiling.below.VARIANTS` (default the floor only, one
    profile); ``()``: none. Pass both to ``make_plan(profile, chunked=...)`` / ``strategy_floors``.
    ``check_positions=False`` profiles a sequence beyond the configuration's positions (what
    memory it would take; :func:`rotary_positions` says whether the model can run it).
    ``progress``: called with a line as each profile ends (a large model's take minutes).

    Raises:
        ConfigError: as :func:`profile_causal_lm`.
    """
    from superneurons.memory.profiling.below import below_profiles

    transformers = _transformers()
    limit = max_positions(config)
    if check_positions and limit is not None and step.seq_len > limit:
        raise ConfigError(
            f"seq_len {step.seq_len} is beyond the {limit} positions of this configuration "
            "(max_position_embeddings): use --seq-len <= that, or --beyond-positions (rotary "
            "positions only) for what memory a longer sequence takes"
        )
    model, mode = _build(transformers, config, step)
    with mode:
        optimizer = _optimizer(step, [p for p in model.parameters() if p.requires_grad])
        ids = torch.zeros(step.batch_size, step.seq_len, dtype=torch.long)  # (B, T)
    batch = {"input_ids": ids, "labels": ids}
    chosen = default_units(model) if units is None else units
    kernels = FusedAttention() if step.target_device == "cuda" else contextlib.nullcontext()
    options: dict[str, Any] = dict(
        fake_mode=mode,
        units=chosen,
        keep_output=step.keep_outputs,
        carry_output=step.keep_outputs,
        autocast=DTYPES[step.autocast] if step.autocast else None,
    )
    report = progress or (lambda _: None)
    with kernels, _unpacked_rows(transformers):
        start_s = time.perf_counter()
        plain = profile_step(model, batch, None, output_loss, optimizer, **options)
        report(f"profiled the step: {plain.num_events} events in {_since(start_s)}")
        if not variants:
            return plain, []
        tokens = step.batch_size * step.seq_len
        start_s = time.perf_counter()
        chunked = below_profiles(
            model, batch, None, output_loss, optimizer, profile=plain, tokens=tokens,
            seq_len=step.seq_len, variants=variants, **options,
        )  # fmt: skip
        report(f"profiled the step below the largest layer in {_since(start_s)}")
    return plain, chunked


def _since(start_s: float) -> str:
    return f"{time.perf_counter() - start_s:.1f} s"


class FusedAttention(TorchFunctionMode):
    """Scaled-dot-product attention as CUDA's fused kernels hold it, on fake cpu tensors: the
    output and a log-sum-exp per query (``_scaled_dot_product_flash_attention_for_cpu``, dropout
    dropped: its random state is a few bytes on CUDA, the values are fake)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return _fused_attention(*args, **kwargs)


def _fused_attention(
    query: torch.Tensor,  # (B, H, T, D)
    key: torch.Tensor,  # (B, H_kv, S, D)
    value: torch.Tensor,  # (B, H_kv, S, D)
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    if torch.is_autocast_enabled("cpu"):  # SDPA is on autocast's lower-precision list
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(dtype) for t in (query, key, value))
    output, _lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale
    )
    return output  # (B, H, T, D)


def _build(transformers: Any, config: Any, step: LMStep) -> tuple[torch.nn.Module, Any]:
    """``AutoModelForCausalLM.from_config(config)`` on fake tensors in training mode, adapted
    as ``step`` trains it (:func:`~superneurons.memory.sizing.adapted.adapt`), and its
    ``FakeTensorMode``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode, _quiet(transformers):
        try:
            # ``dtype=`` since transformers 4.56 (``torch_dtype=`` before, still read by 5.x)
            dtype_key = "dtype" if _major(transformers.__version__) >= 5 else "torch_dtype"
            model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation="sdpa", **{dtype_key: DTYPES[step.dtype]}
            )
        except ValueError as exc:  # not a causal LM, or no sdpa support
            first = str(exc).strip().splitlines()[0][:200]
            raise ConfigError(f"cannot build a causal LM from this configuration: {first}") from exc
        model.train()
        if getattr(model.config, "use_cache", False):
            model.config.use_cache = False  # training: no key/value cache, as a plan runs it
    if step.lora is not None:
        with _quiet(transformers):
            adapt(model, step.lora, step.quantize, mode=mode, compute=_compute_dtype(step),
                  target_device=step.target_device)  # fmt: skip
    return model, mode


def _compute_dtype(step: LMStep) -> torch.dtype:
    """The dtype the step's linear layers compute in: autocast's, else the parameters'."""
    return DTYPES[step.autocast] if step.autocast else DTYPES[step.dtype]


def attention_ops(profile: Profile) -> list[str]:
    """The attention kernels the profiled step ran (aten ops whose outputs attention saved)."""
    return sorted({s.op for s in profile.saved if "attention" in s.op})


def _optimizer(step: LMStep, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer | None:
    foreach, fused = step.optimizer_impl == "foreach", step.optimizer_impl == "fused"
    if step.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=foreach, fused=fused)
    if step.optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=foreach, fused=fused)
    return None


@contextlib.contextmanager
def _unpacked_rows(transformers: Any) -> Any:
    """Tell HF's mask builder what a real run finds: each row is one unpacked sequence.

    ``transformers.masking_utils.find_packed_sequence_indices`` reads the position ids to detect
    packed sequences; on fake tensors it cannot, assumes packing and builds a ``(B, 1, T, T)``
    mask, which turns the causal kernels into masked ones (measured on a tiny Llama: 8 MiB of
    mask and expanded copies a real run never holds). Its ops still run; its answer is None.
    """
    masking = getattr(transformers, "masking_utils", None)
    find = getattr(masking, "find_packed_sequence_indices", None)
    if masking is None or find is None:
        yield
        return

    def unpacked(position_ids: torch.Tensor) -> None:
        find(position_ids)
        return None

    masking.find_packed_sequence_indices = unpacked
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = find


@contextlib.contextmanager
def _quiet(transformers: Any) -> Any:
    """transformers' own warnings off while the model is built (its logger is global)."""
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(level)


def _major(version: str) -> int:
    head = version.split(".")[0]
    return int(head) if head.isdigit() else 0


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # an optional dependency
        raise ConfigError("hf: models need transformers: pip install 'superneurons[hf]'") from exc
    return transformers
