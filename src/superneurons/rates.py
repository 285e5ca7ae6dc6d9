"""Rates as users write them: ``100mbit``, ``1gbit`` (bits per second) or ``12GB/s`` (bytes).

Bit rates are written as tc(8) writes them: a number and ``bit``, ``kbit``, ``mbit`` or ``gbit``,
decimal prefixes (``1gbit`` = 10⁹ bit/s); a bare number is bits per second. Byte rates are a
byte size of :mod:`superneurons.bytesize` followed by ``/s`` (``12GB/s``, ``16GiB/s``), with an
upper-case ``B``: ``100mb/s`` could mean either and is refused. Every rate is returned in bits
per second (``rate_bit_s``); a byte rate is ``rate_bit_s / 8`` bytes per second.
"""

from __future__ import annotations

import re

from superneurons.bytesize import parse_bytes
from superneurons.errors import ConfigError

__all__ = ["format_rate", "parse_rate"]

_BIT_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_BIT_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit)?\s*$", re.IGNORECASE)
_BYTE_RATE = re.compile(r"^\s*(.*[0-9.]\s*(?:[kmgt]i?)?B)/s\s*$", re.IGNORECASE)
_HOW = (
    "write a number and a unit such as 100mbit, 1gbit or 500kbit (bits per second, decimal "
    "prefixes as in tc) or 12GB/s, 16GiB/s (bytes per second)"
)


def parse_rate(text: str) -> int:
    """``text`` (``"100mbit"``, ``"1.5gbit"``, ``"12GB/s"``) in bits per second, > 0.

    Raises:
        ConfigError: the text does not parse (one line saying how to write a rate), or the rate
            is not positive.
    """
    bits = _BIT_RATE.match(text)
    if bits is not None:
        rate_bit_s = round(float(bits.group(1)) * _BIT_UNITS[(bits.group(2) or "bit").lower()])
    else:
        per_second = _BYTE_RATE.match(text)
        if per_second is None or not per_second.group(1).endswith("B"):
            raise ConfigError(f"cannot parse bandwidth {text!r}: {_HOW}")
        try:
            rate_bit_s = 8 * parse_bytes(per_second.group(1))
        except ConfigError:
            raise ConfigError(f"cannot parse bandwidth {text!r}: {_HOW}") from None
    if rate_bit_s <= 0:
        raise ConfigError(f"bandwidth {text!r} must be positive")
    return rate_bit_s


def format_rate(rate_bit_s: float) -> str:
    """``100000000`` -> ``100mbit``: the largest tc unit that divides the rate (the inverse of
    :func:`parse_rate` for whole bit rates)."""
    for unit in ("gbit", "mbit", "kbit"):
        scale = _BIT_UNITS[unit]
        if rate_bit_s >= scale and rate_bit_s % scale == 0:
            return f"{int(rate_bit_s // scale)}{unit}"
    return f"{int(rate_bit_s)}bit"
