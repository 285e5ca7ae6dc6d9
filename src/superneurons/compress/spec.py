"""Codec spec strings: ``"name"`` or ``"name:key=value,key=value"`` -> a codec instance.

The CLI, the DDP hook and benchmark records name codecs by spec string; ``codec.spec`` is the
canonical form (every field, in declaration order) and round-trips:
``parse_spec(codec.spec) == codec``. Values are converted by the codec dataclass's field types
(``int``, ``float``, ``str``, ``bool``, ``X | None``, ``Literal[...]``); the codec's own
``__post_init__`` then validates ranges (e.g. ``theta`` in [0, 1), supported ``bits``).

``CODECS`` is a literal dict, not a registry: adding a codec is one line here.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

from superneurons.compress.adaptive import AdaptiveCodec
from superneurons.compress.cast import Bf16Codec, Fp16Codec, IdentityCodec
from superneurons.compress.codec import Codec
from superneurons.compress.compacttopk import CompactTopKCodec
from superneurons.compress.fft import FFTCodec
from superneurons.compress.qsgd import QSGDCodec
from superneurons.compress.rangefloat import RangeFloatCodec
from superneurons.compress.sign import SignSGDCodec
from superneurons.compress.terngrad import TernGradCodec
from superneurons.compress.topk import TopKCodec
from superneurons.errors import ConfigError

__all__ = ["CODECS", "GRAMMAR", "describe_codecs", "parse_spec"]

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

GRAMMAR = "NAME or NAME:KEY=VALUE[,KEY=VALUE...] (e.g. 'fft:theta=0.9,bits=8', 'topk:ratio=0.01')"

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


def _fields(cls: type) -> dict[str, Any]:
    """Init fields of a codec dataclass -> resolved type annotation."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _defaults(cls: Any) -> dict[str, Any]:
    """Init fields with a default -> the default."""
    return {
        f.name: f.default
        for f in dataclasses.fields(cls)
        if f.init and f.default is not dataclasses.MISSING
    }


def _type_name(tp: Any) -> str:
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


def parse_spec(text: str) -> Codec:
    """Build a codec from ``"name"`` or ``"name:key=value,..."`` (see :data:`GRAMMAR`).

    Raises:
        ConfigError: unknown codec (lists the names), unknown key (lists the fields), a value
            of the wrong type (says the expected type), a malformed string (shows the grammar),
            or a value the codec rejects (the codec's own message).
    """
    if not isinstance(text, str):
        raise ConfigError(f"codec spec must be a string ({GRAMMAR}), got {type(text).__name__}")
    name, sep, rest = text.strip().partition(":")
    name = name.strip().lower()
    if not name:
        raise ConfigError(f"codec spec {text!r} has no codec name; expected {GRAMMAR}")
    if name not in CODECS:
        raise ConfigError(f"unknown codec {name!r}; valid codecs: {', '.join(CODECS)}")
    cls = CODECS[name]
    fields = _fields(cls)
    kwargs: dict[str, Any] = {}
    if sep and not rest.strip():
        raise ConfigError(f"malformed codec spec {text!r}: nothing after ':'; expected {GRAMMAR}")
    for item in rest.split(",") if rest.strip() else []:
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key or not value:
            raise ConfigError(
                f"malformed codec spec {text!r}: {item.strip()!r} is not KEY=VALUE; "
                f"expected {GRAMMAR}"
            )
        if key not in fields:
            valid = ", ".join(fields) if fields else "none (it takes no parameters)"
            raise ConfigError(f"codec {name!r} has no parameter {key!r}; valid: {valid}")
        if key in kwargs:
            raise ConfigError(f"codec spec {text!r} sets {key!r} twice")
        try:
            kwargs[key] = _convert(value, fields[key])
        except ValueError:
            raise ConfigError(
                f"codec {name!r}: {key}={value!r} must be {_type_name(fields[key])}"
            ) from None
    codec: Codec = cls(**kwargs)
    return codec


def describe_codecs() -> str:
    """Each codec's name, one-sentence summary and defaults, for ``--help`` texts."""
    lines = [f"codec spec: {GRAMMAR}"]
    for name, cls in CODECS.items():
        paragraph = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
        summary = paragraph.replace("``", "").split(". ")[0].rstrip(".")
        defaults = ",".join(f"{key}={value}" for key, value in _defaults(cls).items())
        lines.append(f"  {name:<10} {summary}")
        if defaults:
            lines.append(f"  {'':<10} default: {name}:{defaults}")
    return "\n".join(lines)
