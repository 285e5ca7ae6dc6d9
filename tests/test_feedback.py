"""Error feedback loses nothing, survives checkpoints and bucket rebuilds, and is not
poisoned by non-finite steps."""

from __future__ import annotations

import io
import math

import pytest
import torch

from superneurons.codecs.codec import Codec
from superneurons.compress import (
    FFTCodec,
    Fp16Codec,
    QSGDCodec,
    Residuals,
    SignSGDCodec,
    TopKCodec,
    feedback_step,
    join_flat,
    split_flat,
)
from superneurons.errors import ConfigError

CODECS: list[Codec] = [
    TopKCodec(ratio=0.05),
    SignSGDCodec(),
    QSGDCodec(levels=4, bucket=64),
    FFTCodec(theta=0.9, bits=8),
]
_EPS = torch.finfo(torch.float32).eps


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.spec)
def test_sent_plus_residual_equals_input(codec: Codec) -> None:
    grad, residual = torch.randn(1000), torch.randn(1000) * 0.1
    payload, new_residual = feedback_step(codec, grad, residual)
    sent = codec.decode(payload)
    scale = float((grad + residual).abs().max())
    torch.testing.assert_close(sent + new_residual, grad + residual, rtol=0, atol=4 * _EPS * scale)
    assert new_residual.dtype == torch.float32


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.spec)
def test_nothing_is_lost_over_many_steps(codec: Codec) -> None:
    """sum(sent_k) + residual_K == sum(grad_k): compression only delays."""
    steps = 20
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(500) for _ in range(steps)]
    residual: torch.Tensor | None = None
    sent_total = torch.zeros(500, dtype=torch.float64)
    for grad in grads:
        payload, residual = feedback_step(codec, grad, residual, generator=gen)
        sent_total += codec.decode(payload).double()
    assert residual is not None
    expected = torch.stack(grads).double().sum(0)
    bound = 8 * steps * _EPS * float(expected.abs().max() + sent_total.abs().max())
    torch.testing.assert_close(sent_total + residual.double(), expected, rtol=0, atol=bound)
    # ... and error feedback is doing something: the residual is not zero for a lossy codec
    assert float(residual.abs().max()) > 0


def test_non_finite_step_keeps_the_old_residual() -> None:
    codec = TopKCodec(ratio=0.1)
    _, residual = feedback_step(codec, torch.randn(100), None)
    bad = torch.randn(100)
    bad[3] = math.nan
    payload, after = feedback_step(codec, bad, residual)
    assert bool(codec.decode(payload).isnan().all())  # the bad step still propagates
    assert torch.equal(after, residual)  # ... but does not poison the residual
    # fp16 overflow of a finite gradient: the decode is inf, the residual stays finite
    payload, after = feedback_step(Fp16Codec(), torch.tensor([1e6, 1.0]), torch.zeros(2))
    assert bool(Fp16Codec().decode(payload).isinf().any())
    assert torch.equal(after, torch.zeros(2))


def test_residual_size_mismatch_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="reset"):
        feedback_step(TopKCodec(), torch.randn(10), torch.zeros(11))
    ef = Residuals(TopKCodec(ratio=0.5))
    ef.step("w", torch.randn(10))
    with pytest.raises(ConfigError, match="reset"):
        ef.step_flat(["w", "b"], [11, 2], torch.randn(13))


def test_split_and_join_flat() -> None:
    flat = torch.arange(10.0)
    parts = split_flat(flat, [3, 0, 7])
    assert [p.numel() for p in parts] == [3, 0, 7]
    assert torch.equal(join_flat(parts), flat)
    with pytest.raises(ConfigError, match="add up"):
        split_flat(flat, [3, 3])
    with pytest.raises(ConfigError):
        join_flat([])


def test_step_flat_keys_residuals_by_name_across_bucket_rebuilds() -> None:
    """DDP rebuilds buckets after step 1: residuals keyed by parameter name must carry over
    whatever the grouping; a bucket-level step equals the per-bucket pure step."""
    codec = TopKCodec(ratio=0.2)
    grads = {"a": torch.randn(30), "b": torch.randn(50), "c": torch.randn(20)}
    ef = Residuals(codec)
    flat = join_flat([grads["a"], grads["b"], grads["c"]])
    payload = ef.step_flat(["a", "b", "c"], [30, 50, 20], flat)
    reference_payload, reference_residual = feedback_step(codec, flat, None)
    assert torch.equal(payload.data, reference_payload.data)
    stored = join_flat([ef.residual(k) for k in ("a", "b", "c")])  # type: ignore[misc]
    assert torch.equal(stored, reference_residual)
    # step 2 with buckets regrouped as [c, a] and [b]
    ef.step_flat(["c", "a"], [20, 30], join_flat([grads["c"], grads["a"]]))
    expected_c_a = join_flat([reference_residual[80:], reference_residual[:30]])
    _, residual_c_a = feedback_step(codec, join_flat([grads["c"], grads["a"]]), expected_c_a)
    assert torch.equal(join_flat([ef.residual("c"), ef.residual("a")]), residual_c_a)  # type: ignore[list-item]
    assert torch.equal(ef.residual("b"), reference_residual[30:80])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unique"):
        ef.step_flat(["a", "a"], [30, 30], torch.randn(60))


def test_state_dict_round_trip_gives_an_identical_continuation() -> None:
    codec = QSGDCodec(levels=2, bucket=16)
    grads = [torch.randn(64) for _ in range(6)]
    original = Residuals(codec)
    gen = torch.Generator().manual_seed(0)
    for grad in grads[:3]:
        original.step("layer.weight", grad, generator=gen)
    state = original.state_dict()
    assert state["residuals"]["layer.weight"].device.type == "cpu"
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    resumed = Residuals(codec)
    resumed.load_state_dict(torch.load(buffer))
    gen_state = gen.get_state()
    gen_resumed = torch.Generator()
    gen_resumed.set_state(gen_state)
    for grad in grads[3:]:
        a = original.step("layer.weight", grad, generator=gen)
        b = resumed.step("layer.weight", grad, generator=gen_resumed)
        assert torch.equal(a.data, b.data)
    assert torch.equal(original.residual("layer.weight"), resumed.residual("layer.weight"))  # type: ignore[arg-type]
    # saving must not alias the live residual
    state["residuals"]["layer.weight"].fill_(123.0)
    assert not bool((original.residual("layer.weight") == 123.0).all())  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "bad", [{}, {"version": 99, "residuals": {}}, {"version": 1, "residuals": {1: 2}}]
)
def test_load_state_dict_rejects_garbage(bad: dict[object, object]) -> None:
    with pytest.raises(ConfigError, match="load_state_dict"):
        Residuals(TopKCodec()).load_state_dict(bad)  # type: ignore[arg-type]


def test_codec_may_change_between_steps() -> None:
    ef = Residuals(TopKCodec(ratio=0.1))
    ef.step("w", torch.randn(100))
    before = ef.residual("w").clone()  # type: ignore[union-attr]
    ef.step("w", torch.zeros(100), codec=TopKCodec(ratio=1.0))  # lossless: flushes the residual
    assert torch.equal(ef.residual("w"), torch.zeros(100))  # type: ignore[arg-type]
    assert float(before.abs().max()) > 0 and ef.keys() == ["w"]
    ef.reset()
    assert ef.keys() == [] and ef.residual("w") is None
