"""``auto`` with Adam(W): the pure prediction and choice, against hand-computed cases."""

from __future__ import annotations

from typing import Any

import pytest

from superneurons.codecs.cast import Fp16Codec
from superneurons.codecs.sign import SignSGDCodec
from superneurons.errors import ConfigError
from superneurons.optim.autoadam import (
    AdamDecision,
    OptimizerTimes,
    dense_bucket_timings,
    one_bit_adam,
    predict_adam_schemes,
    warmup_steps_for,
)
from superneurons.schemes.adam import AdamAuto
from superneurons.schemes.grammar import parse_scheme
from superneurons.strategy.codecs import CodecCost
from superneurons.strategy.netmodel import ring_network

# Free codecs (no encode/decode time): only the wire differs.
SIGN = CodecCost(SignSGDCodec(), False, 0.0, 0.0, 1.0, 0.5)
FP16 = CodecCost(Fp16Codec(), True, 0.0, 0.0, 16.0, 0.0)


def _predict(sizes: list[int], **overrides: Any) -> tuple[float, float]:
    """``predict_adam_schemes`` over 200 steps with 20 warm-up steps, 25 MiB buckets and the
    zero-cost sign/fp16 codecs unless ``overrides`` say otherwise."""
    options: dict[str, Any] = {
        "sign_cost": SIGN,
        "wire_cost": FP16,
        "warmup_steps": 20,
        "total_steps": 200,
        "bucket_cap_bytes": 25 * 2**20,
    }
    return predict_adam_schemes(sizes, **{**options, **overrides})


def _adam_auto(text: str) -> AdamAuto:
    parsed = parse_scheme(text, adam=True)
    assert isinstance(parsed, AdamAuto)
    return parsed


def test_auto_under_adam_is_a_production_of_the_one_grammar() -> None:
    assert _adam_auto("auto") == AdamAuto()
    assert _adam_auto("auto:link=100mbit") == AdamAuto(link_bit_s=100_000_000)
    assert _adam_auto("auto:link=1.5gbit,margin=0.2") == AdamAuto(1_500_000_000, 0.2)
    assert not isinstance(parse_scheme("auto", adam=False), AdamAuto)  # the hook's auto
    for text in ("auto", "auto:link=100mbit", "auto:link=10kbit,margin=0.1"):
        assert str(_adam_auto(text)) == text
    with pytest.raises(ConfigError, match="--optimizer sgd"):
        _adam_auto("auto:observe_steps=3")
    with pytest.raises(ConfigError, match="100mbit"):
        _adam_auto("auto:link=fast")
    with pytest.raises(ConfigError, match="margin"):
        _adam_auto("auto:margin=1.5")
    with pytest.raises(ConfigError, match="--optimizer adam"):
        parse_scheme("auto:link=100mbit", adam=False)


def test_warmup_is_a_tenth_of_the_run_and_at_least_twenty_steps() -> None:
    config = AdamAuto()
    assert warmup_steps_for(200, config) == 20
    assert warmup_steps_for(1000, config) == 100
    assert warmup_steps_for(1001, config) == 101
    assert warmup_steps_for(5, config) == 20
    assert str(one_bit_adam(20)) == "adam-momentum[warmup=20,wire=fp16]:signsgd"


def test_dense_buckets_fill_in_reverse_and_are_ready_in_proportion() -> None:
    # 4 bytes per element, cap 140 bytes = 35 elements: [p2 (30) + p1 (20)] then [p0 (10)]
    buckets = dense_bucket_timings([10, 20, 30], bucket_cap_bytes=140, backward_s=0.6)
    assert [b.params for b in buckets] == [("p2", "p1"), ("p0",)]
    assert [b.numel for b in buckets] == [50, 10]
    assert buckets[0].ready_s == pytest.approx(0.6 * 50 / 60)
    assert buckets[1].ready_s == pytest.approx(0.6)


def test_a_slow_link_predicts_one_bit_adam_faster() -> None:
    # 1e6 fp32 elements in one bucket, backward 0.1 s, 1 MB/s, no latency, 2 ranks:
    # dense all-reduce 2(P-1)/P * 4e6 B / 1e6 B/s = 4 s after backward -> 4.1 s;
    # fp16 warm-up: 2 s -> 2.1 s; sign: all-gather (P-1) * 125_000 B -> 0.125 s -> 0.225 s;
    # mean over 200 steps with 20 warm-up: (20 * 2.1 + 180 * 0.225) / 200 = 0.4125 s.
    network = ring_network(2, alpha_s=0.0, bandwidth_bytes_per_s=1e6)
    dense_s, compressed_s = _predict(
        [1_000_000],
        backward_s=0.1,
        network=network,
    )
    assert dense_s == pytest.approx(4.1)
    assert compressed_s == pytest.approx(0.4125)
    # each optimizer's measured step adds to its own scheme's steps
    dense_s, compressed_s = _predict(
        [1_000_000],
        backward_s=0.1,
        network=network,
        optimizer_s=OptimizerTimes(adamw_s=0.01, warmup_s=0.02, compressed_s=0.03),
    )
    assert dense_s == pytest.approx(4.11)
    assert compressed_s == pytest.approx((20 * 2.12 + 180 * 0.255) / 200)


def test_a_fast_link_predicts_dense_faster() -> None:
    # 1 TB/s: the wire is free; dense overlaps its all-reduce with backward, while 1-bit Adam
    # pays its encode (1 ns per byte = 4 ms on 4 MB) after backward.
    network = ring_network(2, alpha_s=0.0, bandwidth_bytes_per_s=1e12)
    sign = CodecCost(SignSGDCodec(), False, 1e-9, 0.0, 1.0, 0.5)
    fp16 = CodecCost(Fp16Codec(), True, 1e-9, 0.0, 16.0, 0.0)
    dense_s, compressed_s = _predict(
        [1_000_000],
        backward_s=0.1,
        network=network,
        sign_cost=sign,
        wire_cost=fp16,
    )
    assert dense_s == pytest.approx(0.1 + 4e6 / 1e12)
    assert compressed_s > dense_s


def test_many_buckets_hide_dense_all_reduce_under_backward() -> None:
    # Ten 1 MB buckets ready every 0.1 s of a 1 s backward, each all-reduce 0.05 s: all but the
    # last hide under backward -> 1.05 s; 1-bit Adam all after backward is never below 1 s.
    network = ring_network(2, alpha_s=0.0, bandwidth_bytes_per_s=4 * 250_000 / 0.05)
    dense_s, compressed_s = _predict(
        [250_000] * 10,
        backward_s=1.0,
        network=network,
        bucket_cap_bytes=1_000_000,
    )
    assert dense_s == pytest.approx(1.05)
    assert compressed_s > 1.0


def test_decision_round_trips_and_rejects_other_versions() -> None:
    decision = AdamDecision(
        scheme=one_bit_adam(20),
        warmup_steps=20,
        predicted_dense_step_s=0.3,
        predicted_compressed_step_s=0.17,
        backward_s=0.04,
        link="measured",
        network=ring_network(2, alpha_s=0.0, bandwidth_bytes_per_s=1e6).to_dict(),
    )
    assert AdamDecision.from_dict(decision.to_dict()) == decision and decision.compressed
    assert decision.to_dict()["scheme"] == "adam-momentum[warmup=20,wire=fp16]:signsgd"
    with pytest.raises(ConfigError, match="version"):
        AdamDecision.from_dict({**decision.to_dict(), "version": 99})
