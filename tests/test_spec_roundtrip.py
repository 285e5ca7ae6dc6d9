"""The spec grammar round-trips: ``str(parse_spec(s)) == s`` for every canonical spec, and
``parse_spec(str(obj)) == obj`` for every name and wrapper with random parameters.

The printers are derived from the dataclass fields (``codecs/canonical.py``), so a field added
to a codec is written and read without a printer to update; this is what holds them together.
"""

from __future__ import annotations

import dataclasses
import random
import typing
from typing import Any

import pytest

from superneurons.codecs.canonical import option_fields
from superneurons.errors import ConfigError
from superneurons.schemes.adam import AdamAuto
from superneurons.schemes.grammar import SPECS, WRAPPERS, parse_scheme, parse_spec

# String options are validated by their codec, not typed: the values each may take.
_CHOICES: dict[str, tuple[str, ...]] = {
    "select": ("exact", "sampled"),
    "index": ("bitmap", "gap", "auto"),
    "scope": ("global", "chunk"),
    "choice": ("rd", "l1"),
    "header": ("fixed", "sparse"),
    "bases": ("spatial", "fourier", "dct", "spatial+dct", "dct+fourier", "fourier+spatial+dct"),
    "rounding": ("nearest", "stochastic"),
    "transform": ("none", "hadamard", "dct"),
}
_INTS = (1, 2, 3, 4, 5, 8, 16, 32, 64, 100, 128, 255, 512, 1000, 4096)
SEEDS = range(5)


def _value(name: str, tp: Any, rng: random.Random) -> Any:
    args = typing.get_args(tp)
    if type(None) in args:
        return None if rng.random() < 0.3 else _value(name, args[0], rng)
    if tp is bool:
        return rng.random() < 0.5
    if tp is int:
        return rng.choice(_INTS) if rng.random() < 0.7 else rng.randint(1, 10_000)
    if tp is float:
        kind = rng.random()
        if kind < 0.4:
            return rng.random()  # full precision: repr must survive the round trip
        if kind < 0.7:
            return round(rng.uniform(0.0, 1.0), rng.randint(1, 4))
        return rng.choice([1e-05, 0.5, 1.0, 2.5, 3.0, 10.0, 123.456])
    if tp is str:
        return rng.choice(_CHOICES[name])
    raise AssertionError(f"no random value for {name}: {tp}")


def random_config(cls: type, rng: random.Random, inner: Any = None) -> Any:
    """A valid instance of ``cls`` with random options (rejection sampling on ConfigError)."""
    hints = typing.get_type_hints(cls, localns={"Compression": object})
    for _ in range(500):
        kwargs = {f.name: _value(f.name, hints[f.name], rng) for f in option_fields(cls)}
        try:
            return cls(inner, **kwargs) if inner is not None else cls(**kwargs)
        except ConfigError:
            continue
    raise AssertionError(f"no valid random {cls.__name__} in 500 draws")


def _canonical_defaults() -> list[str]:
    return [str(cls()) for cls in dict.fromkeys(SPECS.values())]


@pytest.mark.parametrize("text", _canonical_defaults())
def test_every_canonical_spec_prints_as_it_parses(text: str) -> None:
    assert str(parse_spec(text)) == text


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_name_round_trips_with_random_parameters(name: str, seed: int) -> None:
    rng = random.Random(f"{name}/{seed}")
    config = random_config(SPECS[name], rng)
    text = str(config)
    assert parse_spec(text) == config
    assert str(parse_spec(text)) == text
    assert config.spec == text


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_every_wrapper_round_trips_around_random_schemes(wrapper: str, seed: int) -> None:
    rng = random.Random(f"{wrapper}/{seed}")
    base = random_config(SPECS[rng.choice(sorted(SPECS))], rng)
    outer = random_config(WRAPPERS[wrapper], rng, inner=base)
    for name in rng.sample(sorted(WRAPPERS), k=2):  # nest two more
        outer = random_config(WRAPPERS[name], rng, inner=outer)
    text = str(outer)
    assert parse_spec(text) == outer
    assert str(parse_spec(text)) == text


def test_every_option_is_a_field_in_declaration_order() -> None:
    for cls in dict.fromkeys([*SPECS.values(), *WRAPPERS.values()]):
        config = cls() if "inner" not in {f.name for f in dataclasses.fields(cls)} else None
        if config is None:
            continue
        keys = [part.split("=")[0] for part in str(config).partition(":")[2].split(",") if part]
        assert keys == [f.name for f in option_fields(cls)], cls.__name__


@pytest.mark.parametrize("seed", SEEDS)
def test_auto_under_adam_round_trips_with_a_random_stated_link(seed: int) -> None:
    # rates and latencies print in their units (link=..., latency=...) and read back exactly
    rng = random.Random(f"adam-auto/{seed}")
    rate_bit_s = rng.choice([10_000, 100 * 10**6, 10**9, 1_500_000, rng.randint(1, 10**12)])
    latency_ns = rng.choice([0, 1, 50_000, 1_500_000, 2 * 10**9, rng.randint(0, 10**10)])
    config = AdamAuto(rate_bit_s, round(rng.random(), 3), latency_ns=latency_ns)
    text = str(config)
    assert parse_scheme(text, adam=True) == config
    assert str(parse_scheme(text, adam=True)) == text
