"""The α-β network model and the predicted step time, against hand-computed cases."""

from __future__ import annotations

import math

import pytest

from superneurons.codecs.powersgd import PowerSGD
from superneurons.errors import ConfigError
from superneurons.schemes.grammar import parse_spec
from superneurons.strategy import (
    DENSE,
    BucketTiming,
    CodecCost,
    LinkModel,
    NetworkModel,
    bucket_key,
    fit_link,
    predicted_step_s,
    ring_network,
)

MB = 1_000_000


def test_link_time_is_alpha_plus_beta_bytes() -> None:
    link = LinkModel(alpha_s=1e-4, beta_s_per_byte=1e-8)
    assert link.time_s(MB) == pytest.approx(1e-4 + 1e-2)
    assert link.time_s(0) == 0.0  # nothing to send: no call, no latency


def test_fit_link_recovers_exact_line() -> None:
    sizes = [4096, 262_144, 4_194_304]
    link = fit_link(sizes, [2e-4 + 3e-9 * s for s in sizes])
    assert link.alpha_s == pytest.approx(2e-4)
    assert link.beta_s_per_byte == pytest.approx(3e-9)


def test_fit_link_clamps_negative_coefficients() -> None:
    # Noise that would give α < 0: the fit through the origin instead.
    link = fit_link([1000, 2000, 3000], [0.0, 1.0, 2.0])
    assert link.alpha_s == 0.0
    assert link.beta_s_per_byte == pytest.approx((1000 * 0 + 2000 + 3000 * 2) / 14e6)
    # Times falling with size: no slope, the mean latency.
    flat = fit_link([1000, 2000], [2.0, 1.0])
    assert (flat.alpha_s, flat.beta_s_per_byte) == (1.5, 0.0)


def test_network_model_dict_round_trip_and_version() -> None:
    net = ring_network(4, alpha_s=5e-5, bandwidth_bytes_per_s=1.25e8)
    assert NetworkModel.from_dict(net.to_dict()) == net
    with pytest.raises(ConfigError, match="version"):
        NetworkModel.from_dict({**net.to_dict(), "version": 99})
    with pytest.raises(ConfigError):
        LinkModel(alpha_s=-1.0, beta_s_per_byte=0.0)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_all_gather_pays_only_when_ratio_exceeds_half_the_ranks(world: int) -> None:
    """Ring all-reduce moves 2(P−1)/P·S per rank, all-gather (P−1)·S/CR: CR > P/2 pays."""
    net = ring_network(world, alpha_s=0.0, bandwidth_bytes_per_s=1e8)
    size = 100 * MB
    assert net.all_reduce.time_s(size) == pytest.approx(2 * (world - 1) / world * size / 1e8)
    for ratio in (world / 2 * 0.9, world / 2 * 1.1):
        gathered = net.all_gather.time_s(math.ceil(size / ratio))
        assert gathered == pytest.approx((world - 1) * size / ratio / 1e8, rel=1e-6)
        assert (gathered < net.all_reduce.time_s(size)) == (ratio > world / 2)


def _cost(spec: str, bits: float, *, summable: bool = False, enc: float = 0.0, dec: float = 0.0):
    return CodecCost(parse_spec(spec), summable, enc, dec, bits, 0.1)  # type: ignore[arg-type]


def test_dense_single_bucket_hand_computed() -> None:
    net = NetworkModel(2, LinkModel(0.01, 1e-8), LinkModel(0.01, 1e-8))
    bucket = BucketTiming("b", ("w",), numel=1_000_000, ready_s=0.2)
    # ready 0.2, comm 0.01 + 4e6·1e-8 = 0.05 -> ends 0.25 > backward 0.22
    pred = predicted_step_s([bucket], {"b": DENSE}, backward_s=0.22, network=net)
    assert pred == pytest.approx(0.25)
    # A long backward hides it completely.
    assert predicted_step_s([bucket], {"b": DENSE}, backward_s=1.0, network=net) == 1.0


def test_encode_delays_later_buckets_and_decode_runs_after() -> None:
    net = NetworkModel(2, LinkModel(0.0, 1e-8), LinkModel(0.0, 1e-8))
    first = BucketTiming("a", ("w1",), numel=1_000_000, ready_s=0.1)
    last = BucketTiming("z", ("w2",), numel=1_000_000, ready_s=0.3)
    # 1 ns per input byte encode (4 ms per bucket), 0.5 ns per byte per payload decode
    # (2 payloads: 4 ms), 4 bits per element (0.5 MB -> 5 ms on the wire).
    gathered = _cost("qsgd", 4.0, enc=1e-9, dec=5e-10)  # numbers made up: a gathered codec
    pred = predicted_step_s(
        [last, first], {"a": gathered, "z": gathered}, backward_s=0.3, network=net
    )
    # a: encoded 0.104, sent 0.104-0.109; z: ready 0.3 + 0.008 delay, sent 0.308-0.313;
    # backward ends 0.308; decodes: a at 0.308-0.312, z at max(0.312, 0.313)-0.317.
    assert pred == pytest.approx(0.317)


def test_link_serialises_collectives_in_ready_order() -> None:
    net = NetworkModel(2, LinkModel(0.0, 1e-8), LinkModel(0.0, 1e-8))
    buckets = [BucketTiming(k, (k,), numel=2_500_000, ready_s=0.0) for k in ("x", "y", "z")]
    # three 0.1 s all-reduces, all ready at 0: the link is busy 0.3 s
    pred = predicted_step_s(buckets, dict.fromkeys("xyz", DENSE), backward_s=0.05, network=net)
    assert pred == pytest.approx(0.3)


def test_powersgd_pays_one_latency_per_collective() -> None:
    net = NetworkModel(2, LinkModel(0.01, 0.0), LinkModel(0.01, 0.0))
    bucket = BucketTiming("b", ("w",), numel=1000, ready_s=0.0)
    two = CodecCost(PowerSGD(rank=4), True, 0.0, 0.0, 1.0, 0.1, collectives=2)
    assert predicted_step_s([bucket], {"b": two}, backward_s=0.0, network=net) == 0.02


def test_missing_choice_is_an_error() -> None:
    net = ring_network(2, alpha_s=0.0, bandwidth_bytes_per_s=1e9)
    with pytest.raises(ConfigError, match="no codec chosen"):
        predicted_step_s([BucketTiming("b", ("w",), 10, 0.0)], {}, backward_s=0.0, network=net)


def test_bucket_key_is_order_independent() -> None:
    assert bucket_key(["b.weight", "a.bias"]) == bucket_key(["a.bias", "b.weight"])


def test_powersgd_first_all_reduce_waits_for_a_busy_link() -> None:
    """PowerSGD's P all-reduce runs inside the hook: behind a 0.1 s dense all-reduce issued
    first, backward stalls until it ends (hand-computed: dense 0.1 s, then P 0.01 s, then Q)."""
    net = NetworkModel(2, LinkModel(0.01, 0.0), LinkModel(0.01, 0.0))
    first = BucketTiming("a", ("a",), numel=1000, ready_s=0.0)
    second = BucketTiming("b", ("b",), numel=1000, ready_s=0.0)
    slow_dense = CodecCost(None, True, 0.0, 0.0, 32.0, 0.0)
    net_busy = NetworkModel(2, LinkModel(0.1, 0.0), LinkModel(0.1, 0.0))
    two = CodecCost(PowerSGD(rank=4), True, 0.0, 0.0, 1.0, 0.1, collectives=2)
    # b's P waits for a's all-reduce (0.1 s), takes 0.1 s, Q another 0.1 s; backward (0.05 s)
    # is stalled until P is done at 0.2 s
    choices = {"a": slow_dense, "b": two}
    assert predicted_step_s([first, second], choices, backward_s=0.05, network=net_busy) == (
        pytest.approx(0.3)
    )
    # the stall shows where backward is long: 0.5 s of backward + the 0.2 s stall
    assert predicted_step_s([first, second], choices, backward_s=0.5, network=net_busy) == (
        pytest.approx(0.7)
    )
    assert predicted_step_s([second], {"b": two}, backward_s=0.0, network=net) == 0.02
