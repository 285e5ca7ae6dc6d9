"""Rates as users write them: one parser for bit rates (tc) and byte rates, exact integers."""

from __future__ import annotations

import pytest

from superneurons.durations import format_duration, parse_duration_ns
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


def test_durations_take_a_unit_and_round_trip_in_whole_nanoseconds() -> None:
    assert parse_duration_ns("50us") == parse_duration_ns("50µs") == 50_000
    assert parse_duration_ns("0.2ms") == 200_000
    assert parse_duration_ns("1.5 s") == 1_500_000_000
    assert parse_duration_ns("0us") == 0
    assert format_duration(1_500_000) == "1500us"
    for text in ("50us", "2ms", "1s", "1500ns", "0ns", "44us"):
        assert format_duration(parse_duration_ns(text)) == text


@pytest.mark.parametrize("bad", ["50", "fast", "-1ms", "1 hour", "", "us"])
def test_a_duration_without_its_unit_is_one_line_saying_how_to_write_one(bad: str) -> None:
    with pytest.raises(ConfigError, match="50us") as info:
        parse_duration_ns(bad)
    assert "\n" not in str(info.value)
