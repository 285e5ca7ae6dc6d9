"""Rates as users write them: one parser for bit rates (tc) and byte rates, exact integers."""

from __future__ import annotations

import pytest

from superneurons.errors import ConfigError
from superneurons.rates import format_rate, parse_rate


def test_bit_rates_are_tc_decimal_and_round_trip() -> None:
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("1.5gbit") == 1_500_000_000
    assert parse_rate("500KBIT") == 500_000
    assert parse_rate("8000") == 8_000  # a bare number is bits per second
    for text in ("100mbit", "1gbit", "500kbit", "1500bit", "25gbit"):
        assert format_rate(parse_rate(text)) == text


def test_byte_rates_take_byte_units_and_a_capital_b() -> None:
    assert parse_rate("12GB/s") == 8 * 12 * 10**9
    assert parse_rate("16GiB/s") == 8 * 16 * 2**30
    assert parse_rate("1.5 MB/s") == 8 * 1_500_000
    assert parse_rate("100B/s") == 800


@pytest.mark.parametrize("bad", ["fast", "100mb/s", "100mbps", "GB/s", "-1mbit", "0mbit", ""])
def test_garbage_is_one_line_saying_how_to_write_a_rate(bad: str) -> None:
    with pytest.raises(ConfigError, match="bandwidth") as info:
        parse_rate(bad)
    assert "\n" not in str(info.value)
