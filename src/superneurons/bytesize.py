"""Byte sizes as users write them: ``12GiB``, ``512MB``, ``1.5g``, ``4096``.

Binary suffixes (KiB, MiB, GiB, TiB and the one-letter k/m/g/t) are powers of 1024; decimal
ones (KB, MB, GB, TB) powers of 1000, as in IEC 80000-13.
"""

from __future__ import annotations

import math
import re

from superneurons.errors import ConfigError

__all__ = ["format_bytes", "parse_bytes"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """Parse ``text`` (e.g. ``"12GiB"``) into a positive number of bytes.

    Raises:
        ConfigError: the text does not parse, or the size is zero or negative.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value_bytes = text
    else:
        match = _PATTERN.match(str(text))
        if match is None or match.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"cannot parse size {text!r}: write a number with an optional unit, "
                "e.g. 12GiB, 512MiB, 1.5GB or 4096 (bytes)"
            )
        number = float(match.group(1))
        value_bytes = math.floor(number * _UNITS[match.group(2).lower()])
    if value_bytes <= 0:
        raise ConfigError(f"size must be positive, got {text!r}")
    return int(value_bytes)


def format_bytes(num_bytes: float) -> str:
    """Format a byte count with a binary unit, e.g. ``1.50 GiB``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
