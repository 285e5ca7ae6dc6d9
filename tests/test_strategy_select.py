"""Per-bucket selection: hand-computed cases (fast link, slow link, last bucket first)."""

from __future__ import annotations

import pytest
import torch

from superneurons.codecs.cast import Fp16Codec
from superneurons.codecs.powersgd import PowerSGD
from superneurons.codecs.sign import SignSGDCodec
from superneurons.codecs.sparse.topk import TopKCodec
from superneurons.errors import ConfigError
from superneurons.strategy import (
    DENSE,
    Assignment,
    BucketTiming,
    CodecCost,
    predicted_step_s,
    ring_network,
    select,
)

# 10M-element buckets (40 MB fp32); codec times in seconds per input fp32 byte.
# fp16: 0.5 ms encode and decode per bucket; top-k 1%: 20 ms encode, 8 ms decode (2 payloads).
NUMEL = 10_000_000
FP16 = CodecCost(Fp16Codec(), True, 1.25e-11, 1.25e-11, 16.0, 1e-3)
TOPK = CodecCost(TopKCodec(ratio=0.01), False, 5e-10, 1e-10, 0.64, 0.3)
NOISY = CodecCost(SignSGDCodec(), False, 1e-11, 1e-11, 0.1, 0.9)  # fast, too lossy
CANDIDATES = [DENSE, FP16, TOPK, NOISY]


def _buckets() -> list[BucketTiming]:
    return [
        BucketTiming("late", ("head.weight",), NUMEL, ready_s=0.5),
        BucketTiming("early", ("body.weight", "body.bias"), NUMEL, ready_s=0.1),
    ]


def test_fast_link_picks_dense() -> None:
    # 100 GB/s: 40 MB all-reduce ~0.4 ms, hidden under backward, so compressing only costs.
    net = ring_network(2, alpha_s=1e-5, bandwidth_bytes_per_s=1e11)
    result = select(_buckets(), CANDIDATES, backward_s=0.5, network=net)
    assert set(result.choices.values()) == {None}  # dense
    assert result.predicted_step_s == result.dense_step_s
    assert result.reason.startswith("dense")


def test_slow_link_picks_compression() -> None:
    # 100 Mbit/s: a 40 MB all-reduce takes 3.2 s; top-k moves 0.8 MB per rank in 64 ms.
    net = ring_network(2, alpha_s=1e-4, bandwidth_bytes_per_s=1.25e7)
    result = select(_buckets(), CANDIDATES, backward_s=0.5, network=net)
    assert set(result.choices.values()) == {TOPK.codec}
    assert result.predicted_step_s < 0.2 * result.dense_step_s
    assert result.params == {
        "head.weight": TOPK.codec,
        "body.weight": TOPK.codec,
        "body.bias": TOPK.codec,
    }


def test_bucket_ready_last_is_compressed_first() -> None:
    # 10 GB/s: each dense all-reduce takes 4 ms. The early bucket's hides under the 0.4 s of
    # backward left after it; the late one's is exposed, so only it is worth fp16.
    net = ring_network(2, alpha_s=0.0, bandwidth_bytes_per_s=1e10)
    result = select(_buckets(), CANDIDATES, backward_s=0.5, network=net, min_gain=0.001)
    assert result.choices == {"late": FP16.codec, "early": None}
    assert result.to_dict()["choices"] == {"late": "fp16", "early": "dense"}
    dense_s = predicted_step_s(
        _buckets(), {"late": DENSE, "early": DENSE}, backward_s=0.5, network=net
    )
    assert dense_s == pytest.approx(0.504)
    # late: encoded 0.5005, sent 0.5005-0.5025, decoded 0.5025-0.503
    assert result.predicted_step_s == pytest.approx(0.503)


def test_error_budget_is_respected() -> None:
    # A slow link where the 1-bit codec would be fastest; it is over the budget.
    net = ring_network(2, alpha_s=1e-4, bandwidth_bytes_per_s=1.25e6)
    result = select(_buckets(), CANDIDATES, backward_s=0.5, network=net, max_rel_error=0.5)
    assert NOISY.codec not in result.choices.values()
    loose = select(_buckets(), CANDIDATES, backward_s=0.5, network=net, max_rel_error=1.0)
    assert NOISY.codec in loose.choices.values()
    only_dense = select(_buckets(), CANDIDATES, backward_s=0.5, network=net, max_rel_error=0.0)
    assert set(only_dense.choices.values()) == {None}


def test_low_rank_candidates_have_their_own_budget() -> None:
    # A PowerSGD candidate as fast as NOISY, with a one-shot error of 0.75: over the general
    # budget (0.5), within the low-rank one (0.8); NOISY (0.9) stays excluded by both.
    low_rank = CodecCost(PowerSGD(rank=4), True, 1e-11, 1e-11, 0.1, 0.75)
    net = ring_network(2, alpha_s=1e-4, bandwidth_bytes_per_s=1.25e6)
    costs = [*CANDIDATES, low_rank]
    strict = select(_buckets(), costs, backward_s=0.5, network=net, max_rel_error=0.5)
    assert low_rank.codec not in strict.choices.values()
    split = select(
        _buckets(), costs, backward_s=0.5, network=net, max_rel_error=0.5, max_rel_error_lowrank=0.8
    )
    assert set(split.choices.values()) == {low_rank.codec}
    assert NOISY.codec not in split.choices.values()
    with pytest.raises(ConfigError):
        select(_buckets(), costs, backward_s=0.5, network=net, max_rel_error_lowrank=-1.0)


def test_never_predicts_slower_than_dense() -> None:
    for bandwidth in (1e6, 1e7, 1e8, 1e9, 1e10, 1e11):
        net = ring_network(2, alpha_s=1e-4, bandwidth_bytes_per_s=bandwidth)
        result = select(_buckets(), CANDIDATES, backward_s=0.3, network=net)
        assert result.predicted_step_s <= result.dense_step_s


def test_dense_is_added_when_missing_and_select_is_deterministic() -> None:
    net = ring_network(2, alpha_s=1e-4, bandwidth_bytes_per_s=1.25e7)
    first = select(_buckets(), [TOPK], backward_s=0.5, network=net)
    again = select(list(reversed(_buckets())), [TOPK], backward_s=0.5, network=net)
    assert first.choices == again.choices and first.predicted_step_s == again.predicted_step_s


def test_whole_step_prediction_and_every_fixed_choice_are_recorded() -> None:
    # One 10M-element bucket ready at 0.5 s = backward's end, 100 Mbit/s, alpha 0: dense's
    # all-reduce moves 2(P-1)/P * 40 MB = 40 MB at 12.5 MB/s = 3.2 s after backward, so from
    # backward's start 0.5 + 3.2 = 3.7 s. fp16: encode 0.5 ms, 1.6 s on the wire, decode
    # 0.5 ms: 0.5 + 0.0005 + 1.6 + 0.0005 = 2.101 s. The 0.25 s outside backward (forward,
    # optimizer) is the same for every choice: it moves the whole step, not the decision.
    net = ring_network(2, alpha_s=0.0, bandwidth_bytes_per_s=1.25e7)
    one = [BucketTiming("only", ("w",), NUMEL, ready_s=0.5)]
    base = select(one, [DENSE, FP16], backward_s=0.5, network=net)
    result = select(one, [DENSE, FP16], backward_s=0.5, network=net, outside_s=0.25)
    assert result.choices == base.choices == {"only": FP16.codec}
    assert result.predicted_step_s == pytest.approx(2.101)
    assert result.predicted_train_step_s == pytest.approx(2.101 + 0.25)
    assert dict(result.by_spec) == pytest.approx({"dense": 3.7, "fp16": 2.101})
    assert result.to_dict()["predicted_train_step_s"] == pytest.approx(2.351)
    assert "+0.25 s outside backward" in result.reason
    with pytest.raises(ConfigError, match="outside_s"):
        select(one, [DENSE], backward_s=0.5, network=net, outside_s=-1.0)


def test_over_budget_candidates_are_predicted_but_never_chosen() -> None:
    net = ring_network(2, alpha_s=1e-4, bandwidth_bytes_per_s=1.25e7)
    result = select(_buckets(), CANDIDATES, backward_s=0.5, network=net, max_rel_error=0.2)
    assert TOPK.codec not in result.choices.values()
    assert set(result.by_spec) == {c.spec for c in CANDIDATES}
    assert result.by_spec[TOPK.spec] < result.predicted_step_s  # faster, over the budget
    assert dict(result.rel_errors) == {c.spec: c.rel_error for c in CANDIDATES}


def test_assignment_json_round_trip() -> None:
    net = ring_network(2, alpha_s=1e-4, bandwidth_bytes_per_s=1.25e7)
    result = select(_buckets(), CANDIDATES, backward_s=0.5, network=net)
    back = Assignment.from_json(result.to_json())
    assert back == result
    assert back.to_json() == result.to_json()
    with pytest.raises(ConfigError, match="version"):
        Assignment.from_json(result.to_json().replace('"version": 1', '"version": 2'))
    with pytest.raises(ConfigError, match="malformed"):
        Assignment.from_json("{}")


def test_bad_inputs_are_config_errors() -> None:
    net = ring_network(2, alpha_s=0.0, bandwidth_bytes_per_s=1e9)
    with pytest.raises(ConfigError, match="at least one bucket"):
        select([], CANDIDATES, backward_s=0.1, network=net)
    twice = [BucketTiming("k", ("a",), 10, 0.0), BucketTiming("k", ("b",), 10, 0.0)]
    with pytest.raises(ConfigError, match="unique"):
        select(twice, CANDIDATES, backward_s=0.1, network=net)


def test_outside_time_starts_at_the_latest_bucket_average_not_the_last_launched() -> None:
    """gloo finishes collectives out of order: a small last bucket can be averaged while a big
    one is still on the wire, so the step ends at its latest average (a 100 Mbit/s
    fc-heavy read 12.5 s 'outside backward' from the last bucket's stamp)."""
    from superneurons.ddp.autorun import AutoController, _Clock
    from superneurons.schemes.auto import Auto

    controller = AutoController(Auto(), error_feedback=True)
    controller._clock = _Clock(torch.device("cpu"))
    # forward ends (t0) at 0.0, 10.0, 20.0; step 1's buckets: the last-launched one averaged at
    # 0.5, the big one at 9.0; step 2's at 19.5 and 19.0 (in completion order)
    controller._ready = [(1, "k", ("a",), 4, 0.0, 0.1), (2, "k", ("a",), 4, 10.0, 10.1)]
    controller._ends = [(1, 0.0, 0.5), (1, 0.0, 9.0), (2, 10.0, 19.0), (2, 10.0, 19.5)]
    controller._t0 = 20.0
    assert controller._step_ends() == {1: 9.0, 2: 19.5}
    # outside = next forward end - latest average: (10 - 9) and (20 - 19.5), median 0.75
    assert controller._outside_s(3) == pytest.approx(0.75)


def test_the_decision_measures_outside_time_up_to_its_own_step() -> None:
    """The decision at step 3 reads steps 1 and 2 (the same marks as above): 0.75 s outside
    backward. Taking the last observed step (2) for the decision's own would date the current
    forward's end to step 2 and read step 1 as 11 s outside backward."""
    from superneurons.ddp.autorun import AutoController, _Clock
    from superneurons.schemes.auto import Auto

    controller = AutoController(Auto(), error_feedback=True)
    controller._clock = _Clock(torch.device("cpu"))
    controller.network = ring_network(2, alpha_s=1e-4, bandwidth_bytes_per_s=1.25e8)
    controller._sample = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    controller._ready = [(1, "k", ("a",), 4, 0.0, 0.1), (2, "k", ("a",), 4, 10.0, 10.1)]
    controller._ends = [(1, 0.0, 0.5), (1, 0.0, 9.0), (2, 10.0, 19.0), (2, 10.0, 19.5)]
    controller._t0 = 20.0
    assignment = controller._select(2, 3)
    assert assignment.outside_s == pytest.approx(0.75)
    assert controller.inputs is not None and controller.inputs.backward_s == pytest.approx(0.1)
