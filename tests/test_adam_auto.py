"""``auto`` with Adam(W): the pure prediction and choice, against hand-computed cases."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from distributed import shared_ranks
from superneurons.codecs.cast import Fp16Codec
from superneurons.codecs.sign import SignSGDCodec
from superneurons.durations import format_duration
from superneurons.errors import ConfigError
from superneurons.optim.autoadam import (
    AdamDecision,
    ComputeTimes,
    OptimizerTimes,
    choose_adam_scheme,
    dense_bucket_timings,
    one_bit_adam,
    predict_adam_schemes,
    stated_link,
    warmup_steps_for,
)
from superneurons.schemes.adam import DEFAULT_LATENCY_NS, AdamAuto
from superneurons.schemes.grammar import parse_scheme
from superneurons.strategy.codecs import CodecCost
from superneurons.strategy.netmodel import ring_network, stated_network
from train_support import STATED_COMPUTE

DEFAULT = format_duration(DEFAULT_LATENCY_NS)

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
    assert _adam_auto("auto:link=1gbit,latency=50us") == AdamAuto(10**9, latency_ns=50_000)
    assert _adam_auto("auto:link=1gbit,latency=0.2ms").latency_ns == 200_000
    assert _adam_auto("auto:link=1gbit") == _adam_auto(f"auto:link=1gbit,latency={DEFAULT}")
    for text in (
        "auto",
        "auto:link=100mbit",
        "auto:link=10kbit,margin=0.1",
        "auto:link=1gbit,latency=50us",
        "auto:link=1gbit,margin=0.1,latency=1500ns",
    ):
        assert str(_adam_auto(text)) == text
    with pytest.raises(ConfigError, match="--optimizer sgd"):
        _adam_auto("auto:observe_steps=3")
    with pytest.raises(ConfigError, match="100mbit"):
        _adam_auto("auto:link=fast")
    with pytest.raises(ConfigError, match="margin"):
        _adam_auto("auto:margin=1.5")
    with pytest.raises(ConfigError, match="50us"):  # a unit is required
        _adam_auto("auto:link=1gbit,latency=50")
    with pytest.raises(ConfigError, match="link=RATE|state its rate"):
        _adam_auto("auto:latency=50us")  # a latency of the measured network means nothing
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


def test_a_stated_link_is_its_rate_and_its_latency_per_message_step() -> None:
    # 1 Gbit/s = 125 MB/s, 50 us per message step; P = 4: a ring all-reduce moves 2(P-1)/P
    # bytes per input byte in 2(P-1) = 6 steps, an all-gather P-1 per sent byte in 3 steps,
    # an all-to-all (P-1)/P in 3 steps
    network = stated_network(4, rate_bit_s=1e9, latency_s=50e-6)
    assert network.world_size == 4
    assert network.all_reduce.alpha_s == pytest.approx(6 * 50e-6)
    assert network.all_reduce.beta_s_per_byte == pytest.approx(1.5 / 125e6)
    assert network.all_gather.alpha_s == pytest.approx(3 * 50e-6)
    assert network.all_gather.beta_s_per_byte == pytest.approx(3 / 125e6)
    assert network.alltoall.alpha_s == pytest.approx(3 * 50e-6)
    assert network.alltoall.beta_s_per_byte == pytest.approx(0.75 / 125e6)
    # the same statement carried to another world size by the module's factors is the same
    assert stated_network(2, rate_bit_s=1e9, latency_s=50e-6).at_world_size(4) == network
    with pytest.raises(ConfigError, match="rate"):
        stated_network(2, rate_bit_s=0, latency_s=0.0)
    # auto's statement: the default latency unless one is stated, and a label saying so
    net, label = stated_link(_adam_auto("auto:link=1gbit"), 2)
    assert net == stated_network(2, rate_bit_s=1e9, latency_s=DEFAULT_LATENCY_NS / 1e9)
    assert label == f"stated: 1gbit, latency {DEFAULT} (ring model, not measured)"


def _choose(text: str, numels: list[int], compute: ComputeTimes = STATED_COMPUTE) -> AdamDecision:
    config = _adam_auto(text)
    network, link = stated_link(config, 2)
    return choose_adam_scheme(
        numels,
        config=config,
        network=network,
        link=link,
        compute=compute,
        total_steps=3,
        bucket_cap_bytes=25 * 2**20,
    )


def test_a_stated_link_and_stated_compute_decide_by_the_link_alone() -> None:
    mlp = [784 * 512, 512, 512 * 256, 256, 256 * 10, 10]  # the MLP's parameters
    slow, fast = _choose("auto:link=10kbit", mlp), _choose("auto:link=1000gbit", mlp)
    # 10 kbit/s: dense all-reduces 2.1 MB (1715 s), 1-bit Adam's fp16 warm-up half of it
    assert slow.scheme_spec == "adam-momentum[warmup=20,wire=fp16]:signsgd"
    assert slow.predicted_compressed_step_s < 0.8 * slow.predicted_dense_step_s
    # 1000 Gbit/s: the wire is free, and 1-bit Adam's steps are slower than AdamW's
    assert fast.scheme_spec == "dense"
    assert fast.predicted_compressed_step_s > fast.predicted_dense_step_s
    # a pure function: the same statement gives the same record; the record says it is stated
    assert _choose("auto:link=1000gbit", mlp).to_dict() == fast.to_dict()
    assert fast.backward_s == STATED_COMPUTE.backward_s and "stated" in fast.link
    with pytest.raises(ConfigError, match="ComputeTimes.backward_s"):
        ComputeTimes(-1.0, STATED_COMPUTE.optimizer)


@contextlib.contextmanager
def _busy_cores() -> Iterator[None]:
    """Two processes spinning (the CI machine's two cores) for as long as the block runs."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def _started(rank: int, world_size: int) -> int:
    return rank


def _decide_stated(rank: int, world_size: int, texts: list[str]) -> list[dict[str, Any]]:
    from superneurons.optim.autoadam import decide_adam_scheme

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    batch = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
    return [
        decide_adam_scheme(
            model,
            batch,
            nn.functional.cross_entropy,
            config=_adam_auto(text),
            total_steps=3,
            bucket_cap_bytes=25 * 2**20,
            compute=STATED_COMPUTE,
        ).to_dict()
        for text in texts
    ]


@pytest.mark.dist
def test_stated_decisions_are_the_same_while_the_cores_are_busy() -> None:
    # the collective decision on 2 ranks beside two busy loops equals the pure function of
    # the statement computed here: no latency, bandwidth or time is measured for it
    texts = ["auto:link=10kbit", "auto:link=100mbit,latency=200us", "auto:link=1000gbit"]
    expected = [_choose(text, [64 * 128, 128, 128 * 10, 10]).to_dict() for text in texts]
    assert expected[0]["scheme"] != "dense" and expected[2]["scheme"] == "dense"
    ranks = shared_ranks(2)
    assert ranks.run(_started, timeout_s=120) == [0, 1]  # up before the cores get busy
    with _busy_cores():
        for decisions in ranks.run(_decide_stated, texts, timeout_s=120):
            assert decisions == expected
