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


def test_network_model_carried_to_another_world_size() -> None:
    """Per-byte times scale with the bytes each rank moves, latencies with the message steps."""
    for p in (2, 4, 8):
        net = ring_network(p, alpha_s=1e-4, bandwidth_bytes_per_s=1.25e8)
        for target in (2, 8, 64, 512):
            moved = net.at_world_size(target)
            expect = ring_network(target, alpha_s=1e-4, bandwidth_bytes_per_s=1.25e8)
            assert moved.world_size == target
            for kind in ("all_reduce", "all_gather", "alltoall"):
                got, want = getattr(moved, kind), getattr(expect, kind)
                assert got.beta_s_per_byte == pytest.approx(want.beta_s_per_byte)
            # ring all-reduce: 2(P-1) message steps, the others P-1: the same ratio
            assert moved.all_reduce.alpha_s == pytest.approx(1e-4 * (target - 1) / (p - 1))
            assert moved.all_gather.alpha_s == pytest.approx(1e-4 * (target - 1) / (p - 1))
    # a two-phase exchange (all-to-all of S, all-gather of S/P) moves a ring's bytes at any P
    for target in (8, 512):
        net = ring_network(2, alpha_s=0.0, bandwidth_bytes_per_s=1e8).at_world_size(target)
        two_phase = net.alltoall.time_s(MB) + net.all_gather.time_s(MB // target)
        assert two_phase == pytest.approx(net.all_reduce.time_s(MB), rel=1e-3)
    with pytest.raises(ConfigError, match="at least 2"):
        NetworkModel(1, LinkModel(0, 0), LinkModel(0, 0)).at_world_size(4)


def test_network_model_reads_version_one_without_all_to_all() -> None:
    old = {
        "version": 1,
        "world_size": 4,
        "all_reduce": {"alpha_s": 1e-4, "beta_s_per_byte": 1e-8},
        "all_gather": {"alpha_s": 2e-4, "beta_s_per_byte": 3e-8},
    }
    net = NetworkModel.from_dict(old)
    assert net.all_to_all is None
    # derived from the all-gather: the same cost per byte a rank receives
    assert net.alltoall == LinkModel(2e-4, 3e-8 / 4)


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


def test_two_phase_waits_for_its_all_to_all_then_gathers_one_slice() -> None:
    """Hand-computed: ready 0.1, encode 0.01; the all-to-all (waited for in the hook) of the
    whole payload, the owner's stage, then an all-gather of one slice; decode after both."""
    from superneurons.codecs.twophase import TwoPhase

    net = ring_network(4, alpha_s=0.0, bandwidth_bytes_per_s=1e8)
    numel = 1_000_000  # 4 MB of fp32; 4 bits + one fp32 scale per 512: 4.0625 bits
    cost = CodecCost(TwoPhase(bits=4), True, 0.01 / 4e6, 0.03 / 4e6, 4.0625, 0.1,
                     collectives=2, owner_s_per_byte=0.02 / 4e6)  # fmt: skip
    payload = cost.payload_bytes(numel)
    alltoall = 3 / 4 * payload / 1e8
    gather = 3 * -(-payload // 4) / 1e8
    bucket = BucketTiming("b", ("w",), numel=numel, ready_s=0.1)
    start = 0.1 + 0.01 + alltoall + 0.02  # the hook returns after the owner's stage
    backward = 0.5  # backward is delayed by the hook: 0.5 + (start - 0.1)
    expected = max(backward + (start - 0.1), start + gather) + 0.01  # + the final decode
    got = predicted_step_s([bucket], {"b": cost}, backward_s=backward, network=net)
    assert got == pytest.approx(expected)
    # its wire time does not grow with P; an all-gathered payload of the same size does
    gathered = CodecCost(parse_spec("qsgd"), False, 0.0, 0.0, 4.0625, 0.1)  # type: ignore[arg-type]
    free = CodecCost(TwoPhase(bits=4), True, 0.0, 0.0, 4.0625, 0.1, collectives=2)
    times = {}
    for p in (8, 64, 512):
        wide = ring_network(p, alpha_s=0.0, bandwidth_bytes_per_s=1e8)
        times[p] = [
            predicted_step_s([bucket], {"b": c}, backward_s=0.0, network=wide) - 0.1
            for c in (free, gathered)
        ]
    assert times[512][0] == pytest.approx(times[8][0], rel=0.15)
    assert times[512][1] / times[8][1] == pytest.approx(511 / 7, rel=0.01)
