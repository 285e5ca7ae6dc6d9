"""Codec benchmark: the --quick path on a tiny gradient writes JSON/MD/PNG with the required
keys, bits per element equal the bytes the codecs actually emit, budgets are respected, and
DDP-style buckets partition the gradient."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from superneurons.bench.codecs.budgets import CodecBenchConfig, run_codec_bench
from superneurons.bench.codecs.gradients import GradientCapture, bucket_bounds
from superneurons.bench.codecs.report import write_codec_artifacts
from superneurons.models import build_model, default_loss, model_input
from superneurons.schemes.grammar import parse_spec

REQUIRED = {"codec", "spec", "model", "bits_per_element", "rel_error", "encode_gbps",
            "decode_gbps", "cosine", "ef_rel_error", "noef_rel_error", "bucket_bytes"}  # fmt: skip


def _tiny_capture(window: int = 3) -> GradientCapture:
    """Real backward passes of a tiny MLP on random batches (no data files needed)."""
    model = build_model("mlp", hidden=(24,))
    params = [(n, p) for n, p in model.named_parameters()][::-1]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = {0: torch.empty(window, sum(p.numel() for _, p in params))}
    for row in range(window):
        inputs, targets = model_input("mlp", 16)
        optimizer.zero_grad()
        default_loss("mlp")(model(inputs), targets).backward()
        grads[0][row] = torch.cat([p.grad.reshape(-1) for _, p in params])
        optimizer.step()
    return GradientCapture(
        model="mlp",
        names=[n for n, _ in params],
        numels=[p.numel() for _, p in params],
        grads=grads,
        losses={0: 2.3},
        train_s=0.0,
    )


@pytest.mark.parametrize("sizes", [[10, 5000, 7, 20000, 3], [1], [40000]])
def test_bucket_bounds_partition(sizes: list[int]) -> None:
    bounds = bucket_bounds(sizes, bucket_bytes=4 * 8000)
    assert bounds[0][0] == 0 and bounds[-1][1] == sum(sizes)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    edges = {0}
    for n in sizes:
        edges.add(max(edges) + n)
    assert {s for s, _ in bounds} <= edges  # buckets hold whole parameters
    assert all((stop - start) * 4 >= 4 * 8000 for start, stop in bounds[:-1])


def test_quick_path_writes_records_that_match_payload_bytes(tmp_path: Path) -> None:
    capture = _tiny_capture()
    config = CodecBenchConfig(budgets_bits=(1.0, 4.0), bucket_bytes=2**9, timing_repeats=1)
    records = run_codec_bench([capture], config)
    paths = write_codec_artifacts(records, tmp_path)
    body = json.loads(paths["json"].read_text())
    assert paths["markdown"].read_text().count("|") > 10 and paths["png"].stat().st_size > 0
    assert body["records"] and all(set(r) >= REQUIRED for r in body["records"])
    families = {r["codec"] for r in body["records"] if r["budget_bits"] == 1.0}
    assert {"fft", "ctopk", "adaptive", "topk", "signsgd"} <= families
    assert body["verdicts"] and "adaptive/ctopk_ef" in body["summary"]

    bounds = bucket_bounds(capture.numels, config.bucket_bytes)
    assert len(bounds) > 1 and all(r["n_buckets"] == len(bounds) for r in records)
    grad = capture.grads[0][0]
    for record in body["records"]:
        codec = parse_spec(record["spec"])
        wire = sum(codec.encode(grad[a:b]).nbytes for a, b in bounds)
        assert record["bits_per_element"] == pytest.approx(8 * wire / grad.numel(), rel=1e-12)
        assert wire == sum(codec.payload_bytes(b - a) for a, b in bounds)
        if record["budget_bits"] is not None:
            assert record["bits_per_element"] <= record["budget_bits"] * 1.07
        assert record["rel_error"] >= 0.0 and -1.0 <= record["cosine"] <= 1.0 + 1e-6
        assert record["encode_gbps"] > 0 and record["decode_gbps"] > 0
    lossless = next(r for r in records if r["codec"] == "identity")
    assert lossless["rel_error"] == 0.0 and lossless["ef_rel_error"] == 0.0


def test_error_feedback_helps_a_biased_sparsifier() -> None:
    capture = _tiny_capture(window=6)
    records = run_codec_bench(
        [capture], CodecBenchConfig(budgets_bits=(1.0,), bucket_bytes=2**20, timing_repeats=1)
    )
    topk = next(r for r in records if r["codec"] == "topk")
    # Top-k drops the same small coordinates every step; error feedback sends them later.
    assert topk["ef_rel_error"] < topk["noef_rel_error"]


def test_speed_records_every_codec_on_the_cpu(tmp_path: Path) -> None:
    from superneurons.bench.codecs.speed import (
        SpeedConfig,
        measure_codec_speed,
        write_speed_artifacts,
    )

    config = SpeedConfig(sizes_mib=(0.01,), repeats=1, specs=("fft", "adaptive", "qsgd"))
    records = measure_codec_speed(config)
    assert [r["codec"] for r in records] == ["fft", "adaptive", "qsgd"]
    for record in records:
        codec = parse_spec(record["spec"])
        assert record["payload_device"] == record["device"] == "cpu"
        assert (
            record["bits_per_element"]
            == 8 * codec.payload_bytes(record["numel"]) / (record["numel"])
        )
        assert record["encode_gbps"] > 0 and record["decode_gbps"] > 0
    paths = write_speed_artifacts(records, tmp_path)
    assert json.loads(paths["json"].read_text())["records"] == records


def test_speed_rejects_cuda_without_a_gpu_and_bad_specs() -> None:
    from superneurons.bench.codecs.speed import SpeedConfig
    from superneurons.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown codec"):
        SpeedConfig(specs=("nope",))
    with pytest.raises(ConfigError, match="device"):
        SpeedConfig(device="mps")


def test_settings_build_codecs_and_the_speed_config_parses_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import collections

    from superneurons.bench.codecs.budgets import bench_settings
    from superneurons.bench.codecs.speed import SpeedConfig, measure_codec_speed
    from superneurons.schemes import grammar

    counts: collections.Counter[str] = collections.Counter()
    check = grammar._check_text

    def counted(text: object) -> None:
        counts[str(text)] += 1
        check(text)

    monkeypatch.setattr(grammar, "_check_text", counted)
    settings = bench_settings([2**16, 4096], (1.0, 4.0))
    assert not counts  # objects all the way: no spec string formatted and read back
    assert all(parse_spec(s.spec) == s.codec for s in settings)  # and they print as they are
    counts.clear()
    config = SpeedConfig(sizes_mib=(0.01,), repeats=1, specs=("fft", "qsgd"))
    measure_codec_speed(config)
    assert counts == {"fft": 1, "qsgd": 1}
