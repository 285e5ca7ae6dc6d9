"""The one spec grammar and the one name table for everything ``--compress`` accepts.

Grammar (parsed once, at the edge, into an object that is passed on as that object)::

    SPEC    := NAME [":" OPTION ("," OPTION)*]           e.g. fft:theta=0.9,bits=8
             | WRAPPER "(" (OPTION ",")* SPEC ")"          e.g. ef(warmup(steps=100,topk))
             | ADAM ["[" OPTION ("," OPTION)* "]"] ":" SPEC
                                                  e.g. adam-momentum[warmup=20,wire=fp16]:signsgd
    OPTION  := KEY "=" VALUE
    SYNC    := SYNCNAME [":" OPTION ("," OPTION)*]        e.g. diloco:steps=50 (train --sync)
             | SYNCNAME "[" OPTION ("," OPTION)* "]" ":" SPEC          e.g. diloco[steps=50]:fp16
    RUN     := SYNC | SPEC ["|" THETA]     e.g. fft|diminishing:until=0.5 (bench labels, .theta)

NAMEs are codecs (``CODECS``), ``powersgd``, PyTorch's anchors (``dense``, ``torch-allreduce``
= ``dense``, ``torch-fp16``, ``torch-powersgd``) and ``auto``; WRAPPERs are ``ef`` (error
feedback), ``warmup`` (dense first steps) and ``rowsparse`` (embeddings as rows + indices). A
wrapper's own options come first and the wrapped spec last, so the wrapped spec's commas never
clash with them. ADAMs are ``adam-momentum`` and ``adam-update`` (:mod:`.adam`: the optimizer
communicates); with an Adam-family optimizer (``parse_spec(text, adam=True)``) ``auto`` names
:class:`~superneurons.schemes.adam.AdamAuto` (``auto:link=100mbit``) instead of the hook's
:class:`~superneurons.schemes.auto.Auto`. ``str(obj)`` (``obj.spec``) is the canonical form,
derived from the fields (:mod:`superneurons.codecs.canonical`), and parses back to an equal
object. ``train --sync`` takes a SYNC (:func:`parse_sync`, the names in ``SYNCS``:
``every-step`` and ``diloco``, :mod:`.diloco`). Values are converted by the dataclass field types (``int``, ``float``, ``str``,
``bool``, ``X | None``, ``Literal[...]``, a codec) or a field's ``rate`` or ``duration``
metadata (:data:`_UNITS`); the class's own ``__post_init__`` validates ranges.

``CODECS`` and ``SPECS`` are literal dicts, not registries: adding a codec is one line in
``CODECS``.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, Literal, Union

from superneurons.codecs.adaptive import AdaptiveCodec
from superneurons.codecs.canonical import option_fields, option_key
from superneurons.codecs.cast import Bf16Codec, Fp16Codec, IdentityCodec
from superneurons.codecs.codec import Codec
from superneurons.codecs.feedback import ErrorFeedback
from superneurons.codecs.powersgd import PowerSGD
from superneurons.codecs.qsgd import QSGDCodec
from superneurons.codecs.rangefloat import RangeFloatCodec
from superneurons.codecs.rowsparse import RowSparse
from superneurons.codecs.schedule import Scheduled, Warmup
from superneurons.codecs.sign import SignSGDCodec
from superneurons.codecs.sparse.compacttopk import CompactTopKCodec
from superneurons.codecs.sparse.fft import FFTCodec
from superneurons.codecs.sparse.topk import TopKCodec
from superneurons.codecs.terngrad import TernGradCodec
from superneurons.codecs.twophase import TwoPhase
from superneurons.durations import parse_duration_ns
from superneurons.errors import ConfigError
from superneurons.rates import parse_rate
from superneurons.schemes.adam import AdamAuto, AdamMomentum, AdamScheme, AdamUpdate
from superneurons.schemes.anchors import TorchDense, TorchFp16, TorchPowerSGD
from superneurons.schemes.auto import Auto
from superneurons.schemes.diloco import DiLoCo, EveryStep, Sync

__all__ = [
    "ADAM",
    "Base",
    "Compression",
    "CODECS",
    "Scheme",
    "GRAMMAR",
    "SPECS",
    "SYNCS",
    "WRAPPERS",
    "describe_codecs",
    "parse_codec",
    "parse_options",
    "parse_scheme",
    "parse_spec",
    "parse_sync",
]

CODECS: dict[str, type[Codec]] = {
    "identity": IdentityCodec,
    "fp16": Fp16Codec,
    "bf16": Bf16Codec,
    "rangefloat": RangeFloatCodec,
    "fft": FFTCodec,
    "topk": TopKCodec,
    "qsgd": QSGDCodec,
    "terngrad": TernGradCodec,
    "signsgd": SignSGDCodec,
    "ctopk": CompactTopKCodec,
    "adaptive": AdaptiveCodec,
}

# Every NAME the grammar accepts: the codecs, then the reductions that are not codecs.
SPECS: dict[str, type] = {
    **CODECS,
    "powersgd": PowerSGD,
    "twophase": TwoPhase,
    "dense": TorchDense,
    "torch-allreduce": TorchDense,  # an alias: str() gives "dense"
    "torch-fp16": TorchFp16,
    "torch-powersgd": TorchPowerSGD,
    "auto": Auto,
}

# What a spec names: a base reduction, or wrappers around one (``Scheduled`` has no spec name).
Base = Codec | PowerSGD | TwoPhase | TorchDense | TorchFp16 | TorchPowerSGD | Auto
Compression = Base | ErrorFeedback | Warmup | Scheduled | RowSparse

WRAPPERS: dict[str, type] = {
    "ef": ErrorFeedback,
    "warmup": Warmup,
    "rowsparse": RowSparse,
}

# The optimizer-side schemes: the optimizer communicates, DDP leaves gradients local.
ADAM: dict[str, type] = {"adam-momentum": AdamMomentum, "adam-update": AdamUpdate}

# Everything a spec can name: what the gradient hook takes, or what the optimizer runs.
Scheme = Compression | AdamScheme | AdamAuto

# What ``train --sync`` names: when ranks synchronise (:mod:`.diloco`).
SYNCS: dict[str, type] = {"every-step": EveryStep, "diloco": DiLoCo}

GRAMMAR = (
    "NAME[:KEY=VALUE,...] or WRAPPER([KEY=VALUE,...,]SPEC) (e.g. 'fft:theta=0.9,bits=8', "
    "'topk:ratio=0.01', 'ef(warmup(steps=100,topk))')"
)
_OPTION = re.compile(r"^\s*[A-Za-z_]\w*\s*=")

_UNITS = {"rate": (parse_rate, "a rate such as 100mbit or 1gbit"),  # metadata: parser, hint
          "duration": (parse_duration_ns, "a duration such as 50us, 0.2ms or 1s")}  # fmt: skip

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


def _fields(cls: type) -> dict[str, tuple[dataclasses.Field[Any], Any]]:
    """Option key -> (field, resolved type) of a spec dataclass (a wrapper's ``inner`` is not
    an option)."""
    hints = typing.get_type_hints(cls, localns={"Compression": object})
    return {option_key(f): (f, hints[f.name]) for f in option_fields(cls)}


def _defaults(cls: Any) -> dict[str, Any]:
    """Option key -> default."""
    return {
        option_key(f): f.default for f in option_fields(cls) if f.default is not dataclasses.MISSING
    }


def _type_name(tp: Any) -> str:
    if tp is Codec:
        return "a codec spec"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    names = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(text: str, tp: Any) -> Any:
    """Convert ``text`` to type ``tp``; raise ValueError when it does not fit."""
    if tp is Codec:
        parsed = _parse(text, text, SPECS)
        if type(parsed) not in CODECS.values():
            raise ValueError(text)
        return parsed
    origin = typing.get_origin(tp)
    if origin is Literal:
        for allowed in typing.get_args(tp):
            try:
                value = _convert(text, type(allowed))
            except ValueError:
                continue
            if value == allowed:
                return value
        raise ValueError(text)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and text.lower() == "none":
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(text, arg)
            except ValueError:
                continue
        raise ValueError(text)
    if tp is bool:
        lowered = text.lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise ValueError(text)
    if tp is int:
        return int(text, 10)
    if tp is float:
        return float(text)
    if tp is str:
        return text
    raise ValueError(f"unsupported field type {tp!r}")


def _valid_names(names: dict[str, type]) -> str:
    adam = [f"{name}[...]:CODEC" for name in ADAM] if names is not SPECS else []
    return ", ".join([*SPECS, *(f"{name}(...)" for name in WRAPPERS), *adam])


def parse_options(name: str, cls: type, items: list[str], text: str) -> dict[str, Any]:
    """``KEY=VALUE`` items -> typed keyword arguments of ``cls`` (every production's options)."""
    fields = _fields(cls)
    kwargs: dict[str, Any] = {}
    hint = getattr(cls, "SPEC_HINT", "")
    for item in items:
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key or not value:
            raise ConfigError(
                f"malformed spec {text!r}: {item.strip()!r} is not KEY=VALUE; expected {GRAMMAR}"
            )
        if key not in fields:
            valid = ", ".join(fields) if fields else "none (it takes no parameters)"
            raise ConfigError(
                f"{name!r} has no parameter {key!r}; valid: {valid}"
                + (f" ({hint})" if hint else "")
            )
        field, tp = fields[key]
        if field.name in kwargs:
            raise ConfigError(f"spec {text!r} sets {key!r} twice")
        unit = next((m for m in _UNITS if field.metadata.get(m)), None)
        try:
            if unit is None:
                kwargs[field.name] = _convert(value, tp)
            else:  # NOTE: "none" is an optional rate's None (link=none)
                none = value.lower() == "none" and unit == "rate"
                kwargs[field.name] = None if none else _UNITS[unit][0](value)
        except (ValueError, ConfigError):
            what = _UNITS[unit][1] if unit else _type_name(tp)
            raise ConfigError(f"{name!r}: {key}={value!r} must be {what}") from None
    return kwargs


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _parse(text: str, whole: str, names: dict[str, type]) -> Any:
    """The object ``text`` names, NAMEs looked up in ``names`` (:data:`SPECS`: the hook's;
    anything else also takes :data:`ADAM`)."""
    stripped = text.strip()
    adam = re.match(r"^(adam-[\w-]+)\s*(?:\[([^\]]*)\])?\s*:(.*)$", stripped, re.IGNORECASE)
    if adam is not None and adam.group(1).lower() in ADAM:
        if names is SPECS:
            raise ConfigError(
                f"{adam.group(1).lower()!r} is an optimizer scheme (the optimizer communicates, "
                "not the gradient hook): give it to train --compress with --optimizer adamw, or "
                "build superneurons.compress.CompressedAdamW"
            )
        name, options, inner = adam.group(1).lower(), adam.group(2), adam.group(3)
        items = options.split(",") if options is not None and options.strip() else []
        if not inner.strip():
            raise ConfigError(
                f"malformed spec {whole!r}: {name} names no codec after ':'; expected {GRAMMAR}"
            )
        codec = _parse(inner, whole, SPECS)
        return ADAM[name](codec, **parse_options(name, ADAM[name], items, whole))
    head, paren, body = stripped.partition("(")
    if paren and ":" not in head:
        name = head.strip().lower()
        if name not in WRAPPERS:
            raise ConfigError(f"unknown wrapper {name!r}; valid names: {_valid_names(names)}")
        if not body.endswith(")"):
            raise ConfigError(
                f"malformed spec {whole!r}: {name}( is not closed; expected {GRAMMAR}"
            )
        items = _split_top_level(body[:-1])
        first_inner = next((i for i, item in enumerate(items) if not _OPTION.match(item)), None)
        if first_inner is None:
            raise ConfigError(
                f"malformed spec {whole!r}: {name}(...) wraps no spec; expected {GRAMMAR}"
            )
        cls = WRAPPERS[name]
        kwargs = parse_options(name, cls, items[:first_inner], whole)
        return cls(_parse(",".join(items[first_inner:]), whole, names), **kwargs)
    name, sep, rest = stripped.partition(":")
    name = name.strip().lower()
    if not name:
        raise ConfigError(f"spec {whole!r} has no name; expected {GRAMMAR}")
    if name not in names:
        raise ConfigError(f"unknown codec {name!r}; valid names: {_valid_names(names)}")
    if sep and not rest.strip():
        raise ConfigError(f"malformed spec {whole!r}: nothing after ':'; expected {GRAMMAR}")
    items = rest.split(",") if rest.strip() else []
    return names[name](**parse_options(name, names[name], items, whole))


def parse_spec(text: str) -> Compression:
    """Build the object ``text`` names (see :data:`GRAMMAR`): a codec, ``PowerSGD``, a PyTorch
    anchor, ``Auto``, or wrappers around one of them: what the gradient hook takes.

    Raises:
        ConfigError: unknown name (one line listing the valid names), unknown key (lists the
            fields), a value of the wrong type (says the expected type), a malformed string
            (shows the grammar), or a value the class rejects (its own message).
    """
    _check_text(text)
    parsed: Compression = _parse(text, text, SPECS)
    return parsed


def parse_scheme(text: str, *, adam: bool) -> Scheme:
    """:func:`parse_spec` for ``train --compress``, which also takes the optimizer's schemes
    (``adam-momentum[...]:CODEC``, ``adam-update[...]:CODEC``).

    ``adam``: the optimizer is Adam-family, so ``auto`` names
    :class:`~superneurons.schemes.adam.AdamAuto` (dense AdamW or 1-bit Adam) instead of the
    hook's per-bucket :class:`~superneurons.schemes.auto.Auto`.

    Raises:
        ConfigError: as :func:`parse_spec`.
    """
    _check_text(text)
    scheme: Scheme = _parse(text, text, {**SPECS, "auto": AdamAuto if adam else Auto})
    return scheme


SYNC_GRAMMAR = "every-step, diloco:steps=H[,lr=F,momentum=F,nesterov=B] or diloco[steps=H,...]:SPEC"


def parse_sync(text: str) -> Sync:
    """``train --sync``: :class:`~superneurons.schemes.diloco.EveryStep` or ``DiLoCo``, whose
    outer gradient's wire (``SPEC`` after ``]:``) is a :func:`parse_spec` codec or ``ef(codec)``.
    Raises ConfigError (one line) for an unknown name, option or value, or a malformed string.
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"empty or missing --sync; expected {SYNC_GRAMMAR}")
    head, bracket, rest = re.match(r"^\s*([\w-]*)\s*(\[?)(.*)$", text, re.DOTALL).groups()  # type: ignore[union-attr]
    if head.lower() not in SYNCS:
        raise ConfigError(f"unknown --sync {head!r}; valid: {', '.join(SYNCS)} ({SYNC_GRAMMAR})")
    cls = SYNCS[head.lower()]
    options, close, wire = rest.partition("]:") if bracket else ("", "", "")
    if bracket and (cls is not DiLoCo or not close or not wire.strip()):
        raise ConfigError(f"malformed --sync {text!r}: expected {SYNC_GRAMMAR}")
    if not bracket:
        colon, options = rest[:1], rest[1:]
        if rest.strip() and (colon != ":" or not options.strip()):
            raise ConfigError(f"malformed --sync {text!r}: expected {SYNC_GRAMMAR}")
    items = options.split(",") if options.strip() else []
    kwargs = parse_options(head.lower(), cls, items, text)
    sync: Sync = cls(parse_spec(wire), **kwargs) if bracket else cls(**kwargs)
    return sync


def _check_text(text: object) -> None:
    if not isinstance(text, str):
        raise ConfigError(f"codec spec must be a string ({GRAMMAR}), got {type(text).__name__}")
    if not text.strip():
        raise ConfigError(f"empty spec; expected {GRAMMAR}")


def parse_codec(text: str) -> Codec:
    """:func:`parse_spec` for callers that need a codec (encode/decode), not a reduction.

    Raises:
        ConfigError: as :func:`parse_spec`, or the name is not a codec (lists the codecs).
    """
    parsed = parse_spec(text)
    if type(parsed) not in CODECS.values():
        raise ConfigError(f"{text!r} is not a codec; codecs: {', '.join(CODECS)}")
    codec: Codec = parsed  # type: ignore[assignment]
    return codec


def describe_codecs() -> str:
    """Each name's one-sentence summary and defaults, for ``--help`` texts."""
    lines = [f"codec spec: {GRAMMAR}"]
    for name, cls in {**SPECS, **WRAPPERS}.items():
        paragraph = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
        summary = paragraph.replace("``", "").split(". ")[0].rstrip(".")
        defaults = ",".join(f"{key}={value}" for key, value in _defaults(cls).items())
        lines.append(f"  {name:<10} {summary}")
        if defaults and name in SPECS:
            lines.append(f"  {'':<10} default: {name}:{defaults}")
    return "\n".join(lines)
