"""The canonical spec string of a config, derived from its dataclass fields (never hand-written).

Everything a spec names (codecs, PowerSGD, PyTorch's anchors, ``auto``, the wrappers, Adam's
schemes) is a frozen dataclass with a ``NAME`` whose init fields are its options, in declaration
order. :func:`spec_of` writes it in one of the grammar's forms
(:mod:`superneurons.schemes.grammar` reads them back)::

    NAME                            no options              fp16, dense
    NAME:KEY=VALUE,...              every option            fft:theta=0.9,bits=8,chunk=512,...
    NAME(KEY=VALUE,...,INNER)       a wrapper (``inner``)   warmup(steps=100,topk:ratio=0.01,...)
    NAME[KEY=VALUE,...]:INNER       ``BRACKETS = True``     adam-momentum[warmup=20,wire=fp16]:signsgd

Values: integers and strings as they are, floats as ``repr`` (``0.9``, ``1e-05``), ``None`` as
``None``, booleans as ``true``/``false``, nested configs by their spec, and fields with
``metadata={"rate": True}`` as tc writes rates (``100mbit``), fields with
``metadata={"duration": True}`` (nanoseconds) in the largest unit that divides them (``50us``).
Field metadata ``"key"`` names the option differently from the field (``link_bit_s`` is written
``link=``); ``"option": False`` keeps a field out of the spec. A class with ``SPEC_DEFAULTS =
False`` writes only the options that differ from their defaults (Adam's schemes, whose short
form is what runs record).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from superneurons.durations import format_duration
from superneurons.rates import format_rate

__all__ = ["Canonical", "option_fields", "option_key", "spec_of"]


def option_fields(cls: Any) -> list[dataclasses.Field[Any]]:
    """The init fields of ``cls`` that are options (not ``inner``, not ``option=False``)."""
    return [
        f
        for f in dataclasses.fields(cls)
        if f.init and f.name != "inner" and f.metadata.get("option", True)
    ]


def option_key(field: dataclasses.Field[Any]) -> str:
    """The option's key in a spec: ``metadata["key"]`` or the field's name."""
    return str(field.metadata.get("key", field.name))


def format_value(value: Any, field: dataclasses.Field[Any]) -> str:
    """One option value as the grammar reads it back."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "true" if value else "false"
    if field.metadata.get("rate"):
        return format_rate(value)
    if field.metadata.get("duration"):
        return format_duration(value)
    if isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return repr(value)
    return str(value.spec)  # a nested config (e.g. Adam's warm-up wire codec)


def spec_of(config: Any) -> str:
    """The canonical spec string of ``config`` (see the module docstring)."""
    cls = type(config)
    options = [
        f"{option_key(f)}={format_value(getattr(config, f.name), f)}"
        for f in option_fields(cls)
        if getattr(cls, "SPEC_DEFAULTS", True) or getattr(config, f.name) != f.default
    ]
    inner = getattr(config, "inner", None)
    if inner is None:
        return cls.NAME + (":" + ",".join(options) if options else "")
    if getattr(cls, "BRACKETS", False):
        return f"{cls.NAME}" + (f"[{','.join(options)}]" if options else "") + f":{inner.spec}"
    return f"{cls.NAME}({','.join([*options, inner.spec])})"


class Canonical:
    """``spec`` and ``str()`` derived from the dataclass fields (:func:`spec_of`)."""

    NAME: ClassVar[str]

    @property
    def spec(self) -> str:
        return spec_of(self)

    def __str__(self) -> str:
        return spec_of(self)
