"""Spec strings: canonical round trip, typed conversion, and helpful errors for bad input."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Literal

import pytest

from superneurons.compress import (
    CODECS,
    SPECS,
    ErrorFeedback,
    TopKCodec,
    TorchDense,
    Warmup,
    compose,
    describe_codecs,
    parse_spec,
)
from superneurons.errors import ConfigError
from superneurons.schemes import grammar as spec_module


@pytest.mark.parametrize(
    "text",
    [
        "identity",
        "fp16",
        "bf16",
        "signsgd",
        "rangefloat:bits=4",
        "fft:theta=0.5,bits=16,chunk=4096,select=sampled,index=gap",
        "fft:theta=0.0,bits=32",
        "topk:ratio=0.001,select=sampled",
        "qsgd:levels=255,bucket=128",
        "terngrad:clip=inf",
    ],
)
def test_round_trip(text: str) -> None:
    codec = parse_spec(text)
    assert parse_spec(codec.spec) == codec
    assert codec.spec.startswith(text.split(":")[0])


def test_partial_spec_fills_defaults_and_tolerates_spaces() -> None:
    assert parse_spec("  TopK : ratio = 0.1 ") == CODECS["topk"](ratio=0.1)  # type: ignore[call-arg]
    assert parse_spec("qsgd:levels=8") == CODECS["qsgd"](levels=8)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("nosuch", "valid names: identity, fp16"),
        ("", "NAME[:KEY=VALUE"),
        (":theta=0.5", "has no name"),
        ("fft:", "nothing after ':'"),
        ("fft:theta", "is not KEY=VALUE"),
        ("fft:theta=", "is not KEY=VALUE"),
        ("fft:theta=0.5,,bits=8", "is not KEY=VALUE"),
        ("fft:bogus=1", "valid: theta, bits, chunk, select, index"),
        ("signsgd:scale=1", "takes no parameters"),
        ("fft:theta=high", "must be a number"),
        ("qsgd:levels=2.5", "must be an integer"),
        ("topk:ratio=0.1,ratio=0.2", "twice"),
        ("fft:theta=1.0", "[0, 1)"),
        ("fft:theta=-0.1", "[0, 1)"),
        ("fft:bits=3", "not supported"),
        ("rangefloat:bits=12", "not supported"),
        ("qsgd:levels=0", "levels"),
        ("topk:select=random", "select"),
        ("fft:chunk=-1", "chunk"),
    ],
)
def test_bad_specs_raise_helpful_config_errors(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_spec(text)
    assert expected in str(info.value)


def test_non_string_spec() -> None:
    with pytest.raises(ConfigError, match="must be a string"):
        parse_spec(0.9)  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Typed:
    """A codec-shaped dataclass exercising every supported field type."""

    flag: bool = False
    size: int | None = None
    mode: Literal["a", "b"] = "a"
    NAME: ClassVar[str] = "typed"


def test_field_types_bool_optional_literal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(spec_module.SPECS, "typed", _Typed)  # type: ignore[arg-type]
    parsed = parse_spec("typed:flag=yes,size=none,mode=b")
    assert parsed == _Typed(flag=True, size=None, mode="b")  # type: ignore[comparison-overlap]
    assert parse_spec("typed:flag=0,size=12") == _Typed(flag=False, size=12)  # type: ignore[comparison-overlap]
    for text, expected in [
        ("typed:flag=maybe", "boolean"),
        ("typed:size=big", "an integer or none"),
        ("typed:mode=c", "one of 'a', 'b'"),
    ]:
        with pytest.raises(ConfigError, match=expected):
            parse_spec(text)


def test_describe_codecs_lists_every_codec() -> None:
    text = describe_codecs()
    assert "NAME[:KEY=VALUE" in text
    for name in CODECS:
        assert f"  {name} " in text
    assert "fft:theta=0.9" in text


# Every name the CLI accepts, and wrappers around them: one grammar, one table.
_EVERY = [
    *(name for name in SPECS),
    "powersgd:rank=2",
    "torch-powersgd:rank=8",
    "auto:observe_steps=2,drift=0.3",
    "auto:max_rel_error_lowrank=0.8",
    "ef(topk:ratio=0.01)",
    "warmup(steps=100,fft:theta=0.95,bits=8)",
    "ef(warmup(steps=5,powersgd:rank=1))",
    "rowsparse(ef(fp16))",
    "warmup(steps=3,dense)",
    " EF( topk : ratio = 0.1 ) ",
]


@pytest.mark.parametrize("text", _EVERY)
def test_every_accepted_name_round_trips(text: str) -> None:
    parsed = parse_spec(text)
    assert parse_spec(parsed.spec) == parsed
    assert str(parsed) == parsed.spec
    assert parse_spec(str(parsed)) == parsed


def test_composed_objects_print_as_parseable_specs() -> None:
    composed = ErrorFeedback(Warmup(TopKCodec(ratio=0.01), steps=100))
    assert str(composed) == "ef(warmup(steps=100,topk:ratio=0.01,select=exact))"
    assert parse_spec(str(composed)) == composed
    assert parse_spec("torch-allreduce") == TorchDense()  # an alias prints as "dense"


@pytest.mark.parametrize("text", ["nosuch", "ef(nosuch)", "foo(topk)", "warmup(steps=2,bogus:x=1)"])
def test_a_bad_name_is_one_line_listing_the_valid_names(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_spec(text)
    message = str(info.value)
    assert "\n" not in message
    for name in ["fft", "topk", "powersgd", "dense", "torch-fp16", "torch-powersgd", "auto"]:
        assert name in message
    assert "ef(...)" in message and "warmup(...)" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ef(", "not closed"),
        ("ef(steps=1)", "wraps no spec"),
        ("warmup(steps=x,fft)", "must be an integer"),
        ("warmup(stepz=1,fft)", "valid: steps"),
        ("warmup(steps=-1,fft)", ">= 0"),
    ],
)
def test_bad_wrapper_specs(text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        parse_spec(text)


def test_compose_builds_the_cli_flags_into_one_object() -> None:
    assert compose("topk", error_feedback=True, warmup_steps=10) == ErrorFeedback(
        Warmup(TopKCodec(), steps=10)
    )
    assert compose("topk", error_feedback=False) == TopKCodec()
    assert compose("dense", error_feedback=True) == TorchDense()  # nothing to feed back
    assert compose("ef(topk)", error_feedback=True) == ErrorFeedback(TopKCodec())
