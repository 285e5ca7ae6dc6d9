"""Durations as users write them: ``50us``, ``0.2ms``, ``1s`` (a link's latency, ``latency=``).

A decimal number and a unit: ``ns``, ``us`` (or ``µs``), ``ms`` or ``s``. A bare number is
refused: tc(8) reads one as microseconds, most people as seconds. Every duration is returned in
whole nanoseconds (``*_ns``), so :func:`format_duration` prints it back exactly.
"""

from __future__ import annotations

import re

from superneurons.errors import ConfigError

__all__ = ["format_duration", "parse_duration_ns"]

_UNITS_NS = {"ns": 1, "us": 10**3, "µs": 10**3, "ms": 10**6, "s": 10**9}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(ns|us|µs|ms|s)\s*$")
_HOW = "write a number and a unit such as 50us, 0.2ms or 1s (ns, us, ms, s)"


def parse_duration_ns(text: str) -> int:
    """``text`` (``"50us"``, ``"0.2ms"``) in nanoseconds, >= 0.

    Raises:
        ConfigError: the text does not parse (one line saying how to write a duration).
    """
    match = _DURATION.match(text) if isinstance(text, str) else None
    if match is None:
        raise ConfigError(f"cannot parse duration {text!r}: {_HOW}")
    return round(float(match.group(1)) * _UNITS_NS[match.group(2)])


def format_duration(duration_ns: int) -> str:
    """``50000`` -> ``50us``: the largest unit that divides the duration (the inverse of
    :func:`parse_duration_ns`)."""
    for unit in ("s", "ms", "us"):
        scale = _UNITS_NS[unit]
        if duration_ns >= scale and duration_ns % scale == 0:
            return f"{duration_ns // scale}{unit}"
    return f"{duration_ns}ns"
