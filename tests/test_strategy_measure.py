"""Measuring the network (2 gloo ranks) and the candidate codecs (CPU)."""

from __future__ import annotations

import pytest
import torch

from distributed import shared_ranks
from superneurons.codecs.cast import Fp16Codec
from superneurons.codecs.powersgd import PowerSGD
from superneurons.codecs.sparse.topk import TopKCodec
from superneurons.strategy import (
    DEFAULT_CANDIDATES,
    DENSE,
    NetworkModel,
    measure_codecs,
    measure_network,
    select,
)
from superneurons.strategy.cost import BucketTiming


def _measure(rank: int, world_size: int) -> dict:
    net = measure_network(device=torch.device("cpu"), sizes_bytes=(2**10, 2**14, 2**18))
    return net.to_dict()


@pytest.mark.dist
def test_measure_network_gives_every_rank_the_same_model() -> None:
    models = shared_ranks(2).run(_measure)
    assert models[0] == models[1]
    net = NetworkModel.from_dict(models[0])
    assert net.world_size == 2
    for link in (net.all_reduce, net.all_gather):
        assert link.alpha_s >= 0 and link.beta_s_per_byte >= 0
        assert link.time_s(2**18) > 0


def test_measure_codecs_costs_are_consistent() -> None:
    torch.manual_seed(0)
    sample = torch.randn(64, 256)  # a weight-shaped gradient
    costs = measure_codecs(DEFAULT_CANDIDATES, sample, repeats=1)
    assert costs[0] == DENSE
    assert [c.codec for c in costs[1:]] == list(DEFAULT_CANDIDATES)
    by_spec = {c.spec: c for c in costs}
    assert len(by_spec) == len(DEFAULT_CANDIDATES) + 1
    assert by_spec["fp16"].bits_per_element == 16.0 and by_spec["fp16"].summable
    assert by_spec["fp16"].rel_error < 2**-10
    topk = by_spec["topk:ratio=0.01,select=exact"]
    assert not topk.summable
    assert topk.bits_per_element == pytest.approx(8 * 8 * round(0.01 * sample.numel()) / 16384)
    # Top-k keeps the largest 1%: the error is below 1 but above 0.
    assert 0.5 < topk.rel_error < 1.0
    low_rank = by_spec["powersgd:rank=4"]
    assert low_rank.collectives == 2 and low_rank.summable
    assert low_rank.bits_per_element == pytest.approx(4 * (64 + 256) * 32 / (64 * 256))
    for cost in costs[1:]:
        assert cost.encode_s_per_byte > 0 and cost.decode_s_per_byte > 0
        # error feedback's own work (add the residual, compute the new one) is measured too;
        # two-phase's is the difference of two timed encodes (with and without feedback),
        # clamped at 0: under load that difference can vanish, so only its sign is checked
        if cost.spec.startswith("twophase"):
            assert cost.feedback_s_per_byte >= 0
        else:
            assert cost.feedback_s_per_byte > 0
    # two-phase: the all-to-all's input per element (codes + a scale per chunk of 512),
    # the owner's stage part of the decode, two collectives, a small error at 4 bits
    for bits, budget in ((4, 0.2), (1, 1.0)):
        two = by_spec[f"twophase:bits={bits},chunk=512,rounding=nearest,transform=none"]
        assert two.two_phase and two.collectives == 2
        assert two.bits_per_element == pytest.approx(bits + 32 / 512)
        assert 0 < two.owner_s_per_byte < two.decode_s_per_byte
        assert 0 < two.rel_error < budget


def test_measure_codecs_feeds_select() -> None:
    sample = torch.randn(4096)
    costs = measure_codecs([Fp16Codec(), TopKCodec(ratio=0.1)], sample)
    from superneurons.strategy import ring_network

    net = ring_network(2, alpha_s=1e-4, bandwidth_bytes_per_s=1e5)  # a very slow link
    bucket = BucketTiming("b", ("w",), 1_000_000, ready_s=0.0)
    result = select([bucket], costs, backward_s=0.0, network=net, max_rel_error=1.0)
    assert result.choices["b"] is not None  # not dense


@pytest.mark.cuda
def test_measure_codecs_on_cuda_times_by_events() -> None:
    sample = torch.randn(256, 1024, device="cuda")
    costs = measure_codecs([Fp16Codec(), TopKCodec(ratio=0.01), PowerSGD(rank=4)], sample)
    assert [c.spec for c in costs][0] == "dense"
    for cost in costs[1:]:
        assert cost.encode_s_per_byte > 0 and cost.decode_s_per_byte > 0


class _Broken:
    spec = "broken"
    summable = False

    def payload_bytes(self, numel: int) -> int:
        return numel

    def encode(self, grad: torch.Tensor, *, generator: object = None) -> object:
        raise RuntimeError("Expected all tensors to be on the same device")

    def decode(self, payload: object) -> torch.Tensor:
        raise AssertionError

    def decode_sum(self, payloads: object) -> torch.Tensor:
        raise AssertionError


def test_a_codec_that_fails_here_is_left_out(caplog: pytest.LogCaptureFixture) -> None:
    costs = measure_codecs([_Broken(), Fp16Codec()], torch.randn(1024))  # type: ignore[list-item]
    assert [c.spec for c in costs] == ["dense", "fp16"]
    assert "broken" in caplog.text
