"""What auto would choose at another world size or link rate: pure, from recorded inputs."""

from __future__ import annotations

import json

import pytest

from superneurons.codecs.cast import Bf16Codec
from superneurons.codecs.sparse.compacttopk import CompactTopKCodec
from superneurons.codecs.twophase import TwoPhase
from superneurons.errors import ConfigError
from superneurons.strategy import (
    DENSE,
    BucketTiming,
    CodecCost,
    DecisionInputs,
    decide_at,
    predicted_steps,
    ring_network,
)
from superneurons.strategy.whatif import implied_link_bit_s

# per-byte costs made up for hand-checkable decisions: a cheap cast, a two-phase exchange whose
# encode and decodes cost a few passes, and a sparsifier that sends 1.1 bits but decodes one
# payload per rank
BF16 = CodecCost(Bf16Codec(), True, 1e-10, 1e-10, 16.0, 0.004)
TWO = CodecCost(TwoPhase(bits=4), True, 5e-10, 5e-10, 4.0625, 0.1, collectives=2,
                feedback_s_per_byte=1e-10, owner_s_per_byte=2e-10)  # fmt: skip
CTOPK = CodecCost(CompactTopKCodec(), False, 5e-10, 2e-10, 1.1, 0.45)


def _inputs(world_size: int = 2, rate_bytes_s: float = 1.25e8) -> DecisionInputs:
    return DecisionInputs(
        buckets=(
            BucketTiming("fc", ("fc.weight",), 25_000_000, 0.05),
            BucketTiming("conv", ("conv.weight", "conv.bias"), 1_000_000, 0.30),
        ),
        costs=(DENSE, BF16, TWO, CTOPK),
        backward_s=0.35,
        outside_s=0.1,
        network=ring_network(world_size, alpha_s=1e-4, bandwidth_bytes_per_s=rate_bytes_s),
        max_rel_error=0.6,
    )


def test_inputs_round_trip_through_json() -> None:
    inputs = _inputs()
    back = DecisionInputs.from_dict(json.loads(json.dumps(inputs.to_dict())))
    assert back == inputs
    assert back.decide() == inputs.decide()
    with pytest.raises(ConfigError):
        DecisionInputs.from_dict({**inputs.to_dict(), "version": 9})


def test_the_same_inputs_choose_differently_at_another_world_size() -> None:
    inputs = _inputs(2)
    here = decide_at(inputs)
    assert here == inputs.decide()
    wide = decide_at(inputs, world_size=512)
    # at 2 ranks the sparsifier's 1.1 bits win the big bucket; at 512 its (P - 1) payloads
    # and decodes lose to the two-phase exchange, whose bytes and decode do not grow
    assert here.choices["fc"] == CompactTopKCodec()
    assert wide.choices["fc"] == TwoPhase(bits=4)
    ctopk, two = CompactTopKCodec().spec, TwoPhase(bits=4).spec
    assert wide.by_spec[ctopk] > 20 * here.by_spec[ctopk]
    # from 8 ranks on, a ring's and a two-phase exchange's bytes per rank are within 15%
    # (2 (P-1)/P); what still grows is one latency per message step
    eight = decide_at(inputs, world_size=8)
    assert wide.by_spec[two] < 1.3 * eight.by_spec[two]


def test_a_faster_link_scales_per_byte_times_and_keeps_compute() -> None:
    inputs = _inputs(8)
    assert implied_link_bit_s(inputs.network) == pytest.approx(1e9)
    fast = decide_at(inputs, link_bit_s=1e11)
    assert fast.choices["fc"] is None  # 100 Gbit/s: nothing pays its encode
    steps = predicted_steps(inputs, ["dense", BF16.spec], link_bit_s=1e11)
    assert steps["dense"] == pytest.approx(fast.dense_step_s + 0.1)
    assert steps["auto"] == pytest.approx(fast.predicted_train_step_s)
    assert steps["dense"] < steps[BF16.spec]  # type: ignore[operator]
    assert predicted_steps(inputs, ["no-such-spec"])["no-such-spec"] is None
