"""The adaptive codec's sparse switch header: the payload size is exact whatever the switch
count, the kept count fills it, mixed switch counts across ranks sum like their decodes, and
the encoder never does worse than sending every chunk in the default basis."""

from __future__ import annotations

import math

import pytest
import torch

from superneurons.codecs.adaptive.codec import AdaptiveCodec, adaptive_layout
from superneurons.codecs.adaptive.switches import COUNT_BYTES, SwitchLayout, switch_code_bits
from superneurons.codecs.codec import Payload, sum_of_decodes
from superneurons.codecs.coding.sparsecode import KeptLayout, kept_count
from superneurons.errors import ConfigError


def _signals(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs that switch no chunk (spikes), every chunk (a smooth ramp), or some (mixed)."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(n, dtype=torch.float32)
    spikes = torch.zeros(n)
    spikes[torch.randint(n, (max(1, n // 200),), generator=gen)] = 5.0
    smooth = torch.cos(t * math.pi / 256) + 0.01 * torch.randn(n, generator=gen)
    return {
        "spikes": spikes,
        "smooth": smooth,
        "mixed": torch.where(t < n / 2, spikes, smooth),
        "normal": torch.randn(n, generator=gen),
    }


def _switched(payload: Payload) -> int:
    return int(payload.data[:COUNT_BYTES].clone().view(torch.int32)[0])


def _layout(codec: AdaptiveCodec, numel: int) -> SwitchLayout:
    return codec._switch_layout(numel)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"theta": 0.99, "index": "gap"},
        {"theta": 0.5, "bits": 4, "index": "bitmap"},
        {"theta": 0.95, "bits": 32, "bases": "spatial+dct"},
        {"theta": 0.9, "bases": "fourier+dct", "chunk": 64},
    ],
    ids=str,
)
@pytest.mark.parametrize("numel", [7, 513, 5000, 20_001])
def test_payload_bytes_exact_for_every_switch_count(kwargs: dict[str, object], numel: int) -> None:
    codec = AdaptiveCodec(header="sparse", **kwargs)  # type: ignore[arg-type]
    length, chunks = adaptive_layout(numel, codec.chunk)
    _, _, fixed_kept = codec._sizes(numel)
    total = codec.payload_bytes(numel)
    assert total == COUNT_BYTES + fixed_kept.nbytes  # a pure function of numel
    layout = _layout(codec, numel)
    kept = layout.kept_by_switched
    assert len(kept) == chunks + 1
    assert kept[0] >= fixed_kept.kept  # no switch: at least the fixed share, in 4 B less
    assert all(a >= b for a, b in zip(kept, kept[1:], strict=False))  # switches cost room
    for switched, count in enumerate(kept):
        used = COUNT_BYTES + layout.switch_bytes(switched)
        if count:
            assert used + layout.message(switched).nbytes <= total
            if count < chunks * length:  # the largest that fits: one more does not
                bigger = KeptLayout(chunks * length, count + 1, 1, codec.bits, codec.index)
                assert used + bigger.nbytes > total
    seen = set()
    for signal in _signals(numel).values():
        payload = codec.encode(signal)
        assert payload.nbytes == total and payload.data.dtype == torch.uint8
        seen.add(_switched(payload))
    if numel >= 5000 and kwargs.get("bases") != "fourier+dct":
        assert len(seen) > 1  # the signals exercise several switch counts


@pytest.mark.parametrize("kwargs", [{}, {"bits": 32, "index": "gap"}, {"bits": 4, "chunk": 64}])
def test_decode_sum_of_mixed_switch_counts_equals_the_sum_of_decodes(
    kwargs: dict[str, object],
) -> None:
    codec = AdaptiveCodec(theta=0.9, header="sparse", **kwargs)  # type: ignore[arg-type]
    signals = list(_signals(3000, seed=3).values())
    payloads = [codec.encode(s) for s in signals]
    assert len({_switched(p) for p in payloads}) >= 3  # ranks chose differently
    summed, each = codec.decode_sum(payloads), sum_of_decodes(codec, payloads)
    # NOTE: allclose, not torch.testing.assert_close, whose first call imports for seconds.
    assert torch.allclose(summed, each, rtol=1e-5, atol=1e-5), float((summed - each).abs().max())


@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("theta", [0.5, 0.9, 0.99])
def test_never_worse_than_the_default_basis_alone(bits: int, theta: float) -> None:
    """The encoder compares its switches with sending every chunk spatially in the same
    bytes (``bases=spatial``: no switch header at all) and keeps the lower squared error."""
    adaptive = AdaptiveCodec(theta=theta, bits=bits, select="exact", header="sparse")
    spatial = AdaptiveCodec(
        theta=theta, bits=bits, select="exact", bases="spatial", header="sparse"
    )
    for name, signal in _signals(8192, seed=1).items():
        assert adaptive.payload_bytes(8192) == spatial.payload_bytes(8192)
        err = float((adaptive.decode(adaptive.encode(signal)) - signal).double().square().sum())
        ref = float((spatial.decode(spatial.encode(signal)) - signal).double().square().sum())
        assert err <= ref * (1 + 1e-5) + 1e-9, name


def test_no_switch_keeps_at_least_the_fixed_headers_share() -> None:
    """With no chunk switched, the 2-bit-per-chunk header's bytes go to coefficients."""
    numel, theta = 2**16, 0.95
    sparse = AdaptiveCodec(theta=theta, header="sparse")
    fixed = AdaptiveCodec(theta=theta, header="fixed")
    payload = sparse.encode(_signals(numel)["spikes"])
    assert _switched(payload) == 0
    chunks = adaptive_layout(numel, 512)[1]
    kept = _layout(sparse, numel).kept(0)
    # The same bytes as the fixed header's payload keep its coefficients plus what its basis
    # codes (C / 4 bytes) less the 4-byte count would buy.
    assert kept >= kept_count(numel, theta)
    bigger = AdaptiveCodec(theta=theta, header="sparse")._switch_layout(numel)
    assert fixed.payload_bytes(numel) - sparse.payload_bytes(numel) == chunks // 4 - COUNT_BYTES
    assert bigger.kept(0) == kept


def test_switch_code_bits() -> None:
    assert [switch_code_bits(b) for b in (1, 2, 3)] == [0, 0, 1]


def test_a_corrupt_switch_count_is_a_config_error() -> None:
    codec = AdaptiveCodec(header="sparse")
    payload = codec.encode(torch.randn(4096))
    data = payload.data.clone()
    data[:COUNT_BYTES] = torch.tensor([1000], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(ConfigError, match="switched chunks"):
        codec.decode(Payload(data, payload.numel))


@pytest.mark.parametrize("bases", ["fourier", "spatial+dct", "spatial+fourier+dct"])
def test_non_finite_input_decodes_to_nan(bases: str) -> None:
    codec = AdaptiveCodec(bases=bases, header="sparse")
    grad = torch.randn(4099)
    grad[17] = float("nan")
    payload = codec.encode(grad)
    assert _switched(payload) == 0 or "+" in bases  # a single basis never switches
    assert payload.nbytes == codec.payload_bytes(4099)
    assert bool(codec.decode_sum([payload, codec.encode(torch.randn(4099))]).isnan().all())
