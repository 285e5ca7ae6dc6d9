"""What a step trains when it trains adapters: ``plan --lora`` and ``plan --quantize``, each read
once from its flag into a frozen, validated record.

Grammar (``KEY=VALUE`` items separated by commas; a bare item continues the list before it)::

    --lora     [r=R][,alpha=A][,dropout=P][,targets=all-linear | targets=NAME[,NAME...]][,dtype=fp32|base]
    --quantize nf4 | int8 [,double_quant=true|false][,blocksize=B]

``--lora`` is PEFT's ``LoraConfig`` (its defaults: ``r=8``, ``lora_alpha=8``, dropout 0,
``bias="none"``); ``targets`` are PEFT's ``target_modules`` (module names matched as PEFT matches
them, or ``all-linear``: every linear layer but the output one). ``dtype`` is the adapters'
dtype: ``fp32`` is what ``get_peft_model`` gives them on any base (``autocast_adapter_dtype=True``
upcasts bf16/fp16 adapters: ``peft/tuners/tuners_utils.py:cast_adapter_dtype``, PEFT 0.21), so
each adapted layer casts its input to fp32 and saves that copy; ``base`` is the base layer's
(compute) dtype, what ``inject_adapter_in_model`` and ``autocast_adapter_dtype=False`` give.

``--quantize`` is bitsandbytes' storage of the base weights as transformers loads them
(``BitsAndBytesConfig``): ``nf4`` is ``Linear4bit`` with ``quant_type="nf4"`` (blocks of
``blocksize`` weights, 64 by default, each with an absmax; ``double_quant``, bitsandbytes'
``compress_statistics`` and QLoRA's recipe, stores those absmax in 8 bits with a second-level
fp32 absmax per 256 blocks); ``int8`` is ``Linear8bitLt`` (int8 weights, one fp32 scale per
output row). The byte formulae are :mod:`superneurons.memory.sizing.quantized`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from superneurons.errors import ConfigError

__all__ = [
    "ADAPTER_DTYPES",
    "ALL_LINEAR",
    "BLOCKSIZES",
    "QUANT_KINDS",
    "LoraSpec",
    "QuantSpec",
    "parse_lora",
    "parse_quantize",
]

ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output layer
ADAPTER_DTYPES: tuple[str, ...] = ("fp32", "base")
QUANT_KINDS: tuple[str, ...] = ("nf4", "int8")
# the block sizes bitsandbytes' quantize_4bit accepts (bitsandbytes/functional.py, 0.50)
BLOCKSIZES: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)
_MODULE_NAME = re.compile(r"^[A-Za-z_][\w.]*$")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters on the base model's linear layers (PEFT's ``LoraConfig``).

    Attributes:
        r: the rank (PEFT's default 8).
        alpha: ``lora_alpha`` (PEFT's default 8, an integer there); scales the update, never
            the memory.
        dropout: ``lora_dropout``: above 0 each adapted layer saves a dropout mask.
        targets: PEFT's ``target_modules``: ``("all-linear",)`` or module names.
        dtype: ``"fp32"`` (``get_peft_model``'s default) or ``"base"`` (the base's dtype).
    """

    r: int = 8
    alpha: int = 8
    dropout: float = 0.0
    targets: tuple[str, ...] = (ALL_LINEAR,)
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ConfigError(f"--lora r must be >= 1, got {self.r}")
        if self.alpha <= 0:
            raise ConfigError(f"--lora alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"--lora dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise ConfigError("--lora targets names no module: use targets=all-linear or names")
        if ALL_LINEAR in self.targets and len(self.targets) > 1:
            raise ConfigError(f"--lora targets={ALL_LINEAR} stands alone, not in a list")
        bad = [t for t in self.targets if t != ALL_LINEAR and not _MODULE_NAME.match(t)]
        if bad:
            raise ConfigError(f"--lora targets {bad[0]!r} is not a module name (e.g. q_proj)")
        if self.dtype not in ADAPTER_DTYPES:
            raise ConfigError(
                f"--lora dtype must be one of {', '.join(ADAPTER_DTYPES)}, got {self.dtype!r}"
            )

    @property
    def target_modules(self) -> str | list[str]:
        """PEFT's ``target_modules`` argument."""
        return ALL_LINEAR if self.targets == (ALL_LINEAR,) else list(self.targets)

    @property
    def spec(self) -> str:
        """The canonical ``--lora`` string (:func:`parse_lora` reads it back to an equal spec)."""
        return (
            f"r={self.r},alpha={self.alpha},dropout={self.dropout:g},dtype={self.dtype},"
            f"targets={','.join(self.targets)}"
        )

    def record(self) -> dict[str, Any]:
        """Its ``plan --json`` fields (``adapter``)."""
        return {
            "kind": "lora",
            "r": self.r,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "targets": list(self.targets),
            "dtype": self.dtype,
            "spec": self.spec,
        }


@dataclass(frozen=True)
class QuantSpec:
    """The base weights at bitsandbytes' storage (frozen; only adapters train).

    Attributes:
        kind: ``"nf4"`` (``Linear4bit``) or ``"int8"`` (``Linear8bitLt``).
        double_quant: (nf4) absmax in 8 bits with fp32 second-level absmax per 256 blocks
            (``compress_statistics``; QLoRA's recipe and ``Linear4bit``'s default).
        blocksize: (nf4) weights per absmax (bitsandbytes' default 64).
    """

    kind: str
    double_quant: bool = True
    blocksize: int = 64

    def __post_init__(self) -> None:
        if self.kind not in QUANT_KINDS:
            raise ConfigError(
                f"--quantize must be one of {', '.join(QUANT_KINDS)}, got {self.kind!r}"
            )
        if self.blocksize not in BLOCKSIZES:
            raise ConfigError(
                f"--quantize blocksize must be one of {', '.join(map(str, BLOCKSIZES))}, "
                f"got {self.blocksize}"
            )
        if self.kind == "int8" and (not self.double_quant or self.blocksize != 64):
            raise ConfigError("--quantize int8 takes no options (one fp32 scale per row)")

    @property
    def spec(self) -> str:
        """The canonical ``--quantize`` string (:func:`parse_quantize` reads it back)."""
        if self.kind == "int8":
            return "int8"
        dq = "true" if self.double_quant else "false"
        return f"nf4,double_quant={dq},blocksize={self.blocksize}"

    def record(self) -> dict[str, Any]:
        """Its ``plan --json`` fields (``quantize``)."""
        fields: dict[str, Any] = {"kind": self.kind, "spec": self.spec}
        if self.kind == "nf4":
            fields.update(double_quant=self.double_quant, blocksize=self.blocksize)
        return fields


def _items(flag: str, text: str) -> dict[str, list[str]]:
    """``KEY=VALUE`` items in order, a bare item appended to the key before it."""
    found: dict[str, list[str]] = {}
    last = None
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise ConfigError(f"{flag} {text!r} has an empty item: write KEY=VALUE,KEY=VALUE")
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq:
            if last is None:
                raise ConfigError(f"{flag} {text!r}: {item!r} is not KEY=VALUE")
            found[last].append(item)
            continue
        if key in found:
            raise ConfigError(f"{flag} {text!r} sets {key!r} twice")
        if not value:
            raise ConfigError(f"{flag} {text!r}: {key}= has no value")
        found[key], last = [value], key
    return found


def _single(flag: str, key: str, values: list[str]) -> str:
    if len(values) != 1:
        raise ConfigError(f"{flag} {key} takes one value, got {','.join(values)!r}")
    return values[0]


def _number(flag: str, key: str, values: list[str], kind: type) -> Any:
    value = _single(flag, key, values)
    try:
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"{flag} {key}={value!r} must be {what}") from None


def parse_lora(text: str) -> LoraSpec:
    """``--lora`` (module docstring's grammar) -> :class:`LoraSpec`.

    Raises:
        ConfigError: an unknown key (names the keys), a malformed item or a value out of range.
    """
    flag, keys = "--lora", ("r", "alpha", "dropout", "targets", "dtype")
    items = _items(flag, text)
    unknown = [k for k in items if k not in keys]
    if unknown:
        raise ConfigError(f"{flag} has no key {unknown[0]!r}: use {', '.join(keys)}")
    options: dict[str, Any] = {}
    if "r" in items:
        options["r"] = _number(flag, "r", items["r"], int)
    if "alpha" in items:
        options["alpha"] = _number(flag, "alpha", items["alpha"], int)
    if "dropout" in items:
        options["dropout"] = _number(flag, "dropout", items["dropout"], float)
    if "targets" in items:
        options["targets"] = tuple(items["targets"])
    if "dtype" in items:
        options["dtype"] = _single(flag, "dtype", items["dtype"]).lower()
    return LoraSpec(**options)


def parse_quantize(text: str) -> QuantSpec:
    """``--quantize`` (module docstring's grammar) -> :class:`QuantSpec`.

    Raises:
        ConfigError: an unknown kind or key, or a value out of range.
    """
    flag = "--quantize"
    kind, _, rest = text.strip().partition(",")
    kind = kind.strip().lower()
    if kind not in QUANT_KINDS:
        raise ConfigError(f"{flag} must be one of {', '.join(QUANT_KINDS)}, got {kind!r}")
    items = _items(flag, rest) if rest.strip() else {}
    keys = ("double_quant", "blocksize")
    unknown = [k for k in items if k not in keys]
    if unknown:
        raise ConfigError(f"{flag} has no key {unknown[0]!r}: use {', '.join(keys)}")
    options: dict[str, Any] = {}
    if "double_quant" in items:
        value = _single(flag, "double_quant", items["double_quant"]).lower()
        if value not in (*_TRUE, *_FALSE):
            raise ConfigError(f"{flag} double_quant={value!r} must be true or false")
        options["double_quant"] = value in _TRUE
    if "blocksize" in items:
        options["blocksize"] = _number(flag, "blocksize", items["blocksize"], int)
    return QuantSpec(kind, **options)
