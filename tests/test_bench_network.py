"""The network benchmark's records: schema, speedups and artifacts, from tiny real runs."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from superneurons.bench.network import run as network
from superneurons.bench.network.report import write_artifacts
from superneurons.bench.network.run import (
    NetworkBenchConfig,
    _wait_all,
    add_speedups,
    run_network_bench,
)
from superneurons.bench.network.worker import analytic_bytes_per_step
from superneurons.cli import main
from superneurons.errors import ConfigError
from superneurons.models import build_model
from superneurons.schemes import grammar
from superneurons.schemes.grammar import parse_spec

TINY = {"mlp": {"hidden": [16]}}
FASHION = Path("/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz")
REQUIRED = {"bandwidth", "model", "codec", "mean_step_s", "speedup_vs_dense", "bytes_per_step"}


def _tiny(**overrides: object) -> NetworkBenchConfig:
    options: dict[str, object] = {
        "bandwidths_bit_s": (None,),
        "models": TINY,
        "codecs": ("dense", "torch-fp16"),
        "warmup_steps": 2,
        "steps": 2,
        "compute_steps": 1,
        "batch_size": 8,
        "shaping": False,
    }
    options.update(overrides)
    return NetworkBenchConfig(**options)  # type: ignore[arg-type]


@pytest.mark.dist
def test_loopback_run_records_and_artifacts(tmp_path: Path) -> None:
    config = _tiny()
    records = run_network_bench(config, progress=lambda _msg: None)
    assert [r["codec"] for r in records] == ["dense", "torch-fp16"]
    for record in records:
        assert record["status"] == "ok", record.get("error")
        assert record.keys() >= REQUIRED
        assert record["mean_step_s"] > 0 and record["compute_step_s"] > 0
        assert record["last_loss"] == pytest.approx(record["last_loss"])  # finite
        # the MLP takes 28x28x1 images with 10 classes: Fashion-MNIST by default, if present
        assert record["data"] == ("real" if FASHION.is_file() else "random")
    numel = sum(p.numel() for p in build_model("mlp", **TINY["mlp"]).parameters())
    dense, fp16 = records
    assert dense["speedup_vs_dense"] == 1.0
    assert dense["bytes_per_step"] == 4 * numel  # ring all-reduce, P=2: 2(P-1)/P x 4 bytes
    assert fp16["bytes_per_step"] == pytest.approx(2 * numel, rel=0.05)  # fp16 on the wire
    assert fp16["speedup_vs_dense"] == pytest.approx(dense["mean_step_s"] / fp16["mean_step_s"])

    paths = write_artifacts(records, tmp_path, config)
    assert {p.name for p in paths} == {"network.json", "network.md", "network.png"}
    body = json.loads((tmp_path / "network.json").read_text())
    assert body["records"][1]["codec"] == "torch-fp16" and "environment" in body
    assert "| loopback | 2 | mlp | torch-fp16 |" in (tmp_path / "network.md").read_text()


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.netns
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("tc") is None, reason="needs root with ip and tc"
)
def test_shaped_run_between_namespaces() -> None:
    config = _tiny(bandwidths_bit_s=(100_000_000,), codecs=("dense",), shaping=True)
    (record,) = run_network_bench(config, progress=lambda _msg: None)
    assert record["status"] == "ok", record.get("error")
    assert record["bandwidth"] == "100mbit"
    assert 50e6 < record["measured_link_bit_s"] < 101e6


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.netns
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("tc") is None, reason="needs root with ip and tc"
)
def test_bytes_received_per_rank_are_measured_on_each_ranks_interface() -> None:
    """2 and 3 ranks (a direct veth pair, then a bridge): the interface counters see what the
    transports move per rank: a ring all-reduce 2 (P-1)/P of 4 bytes per value, the two-phase
    exchange about 2 (P-1)/P of its segment per owner, both plus TCP/IP headers."""
    codecs = ("dense", "twophase:bits=8,chunk=64")
    config = _tiny(bandwidths_bit_s=(1_000_000_000,), codecs=codecs, shaping=True, nprocs=(2, 3))
    config = dataclasses.replace(config, measure_link=False)
    records = run_network_bench(config, progress=lambda _msg: None)
    numel = sum(p.numel() for p in build_model("mlp", **TINY["mlp"]).parameters())
    assert [(r["nproc"], r["codec"]) for r in records] == [(p, c) for p in (2, 3) for c in codecs]
    for record in records:
        assert record["status"] == "ok", record.get("error")
        p = record["nproc"]
        ring = 2 * (p - 1) / p * 4 * numel  # dense: what each rank receives
        received = record["bytes_received_per_rank"]
        if record["codec"] == "dense":
            assert ring < received < 1.3 * ring + 20_000  # headers, the barriers' bytes
        else:
            assert received < ring / 2  # 8 bits: a quarter of fp32 each way, plus scales


def test_unknown_codec_fails_before_any_rank_starts() -> None:
    with pytest.raises(ConfigError):
        _tiny(codecs=("dense", "no-such-codec"))


def test_failed_codec_is_recorded_and_fresh_ranks_run_the_rest(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[tuple[str, ...]] = []
    fields = dict.fromkeys(
        ("mean_step_s", "compute_step_s", "bytes_per_step", "first_loss", "last_loss"), 1.0
    )

    def fake_ranks(config, link, nproc, model, codecs, workdir):  # type: ignore[no-untyped-def]
        calls.append(codecs)
        if "torch-fp16" in codecs:  # the ranks finish dense, then die on torch-fp16
            return [
                {"codec": c, **fields} for c in codecs[: codecs.index("torch-fp16")]
            ], "rank 0 (exit 1): x"
        return [{"codec": c, **fields} for c in codecs], None

    monkeypatch.setattr(network, "_run_ranks", fake_ranks)
    config = _tiny(codecs=("dense", "torch-fp16", "torch-powersgd:rank=4"))
    records = network.run_network_bench(config, progress=lambda _m: None)
    retry = ("torch-fp16", "torch-powersgd:rank=4")
    assert calls == [config.codecs, retry, ("torch-powersgd:rank=4",)]
    assert [(r["codec"], r["status"]) for r in records] == [
        ("dense", "ok"),
        ("torch-fp16", "failed"),
        ("torch-powersgd:rank=4", "ok"),
    ]
    assert records[1]["speedup_vs_dense"] is None and "exit 1" in records[1]["error"]
    assert [r["attempts"] for r in records] == [1, 2, 1]


def test_one_failed_rank_ends_the_others_at_once() -> None:
    """A rank that dies must not leave its peer blocked in a collective until gloo's timeout."""
    procs = [subprocess.Popen(["sleep", "30"]), subprocess.Popen(["false"])]
    start_s = time.monotonic()
    codes = _wait_all(procs, timeout_s=60)
    assert time.monotonic() - start_s < 10
    assert codes[1] == 1 and codes[0] != 0


def test_speedup_is_relative_to_dense_of_the_same_link_and_model() -> None:
    records = [
        {"bandwidth": b, "model": "m", "codec": c, "mean_step_s": s, "status": "ok"}
        for b, c, s in [("1gbit", "dense", 2.0), ("1gbit", "fft", 0.5), ("10mbit", "fft", 1.0)]
    ]
    add_speedups(records)
    assert [r["speedup_vs_dense"] for r in records] == [1.0, 4.0, None]


def test_predictions_come_from_auto_of_the_same_link_and_model() -> None:
    decision = {
        "predicted_step_s": 0.5,
        "outside_s": 0.25,
        "predicted_train_step_s": 0.75,
        "by_spec": {"dense": 1.0, "fp16": 0.75, "qsgd": 0.5},
    }
    records: list[dict[str, object]] = [
        {"bandwidth": "1gbit", "model": "m", "codec": "auto", "status": "ok"},
        {"bandwidth": "1gbit", "model": "m", "codec": "fp16", "status": "ok"},
        {"bandwidth": "1gbit", "model": "m", "codec": "torch-fp16", "status": "ok"},
        {"bandwidth": "1gbit", "model": "other", "codec": "fp16", "status": "ok"},
    ]
    records[0]["sync_assignment"] = decision
    network.add_predictions(records)  # type: ignore[arg-type]
    # auto: its own whole step; fp16: by_spec + outside = 0.75 + 0.25; the rest: no prediction
    assert [r["predicted_train_step_s"] for r in records] == [0.75, 1.0, None, None]


def test_analytic_powersgd_bytes_follow_torch_rule() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.Linear(50, 2))
    # 100x50 compressed to rank 4: 4 (50 + 100); the 2x50 matrix and both biases stay dense.
    expected = 4 * (4 * (50 + 100) + 50 + 2 * 50 + 2)
    numel = 100 * 50 + 50 + 50 * 2 + 2
    assert analytic_bytes_per_step(model, parse_spec("torch-powersgd:rank=4"), 2) == expected
    assert analytic_bytes_per_step(model, parse_spec("dense"), 4) == pytest.approx(1.5 * 4 * numel)


def test_bad_cli_input_is_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "network", "--bandwidth", "fast", "--out", "x"]) == 2
    assert "cannot parse bandwidth" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="nproc"):
        _tiny(nprocs=(1,))
    assert main(["bench", "network", "--nproc", "2,x", "--no-shaping", "--out", "x"]) == 2
    assert "--nproc takes world sizes" in capsys.readouterr().err


def test_from_partial_writes_artifacts_of_an_interrupted_run(tmp_path: Path) -> None:
    fields = {"model": "fc-heavy", "status": "ok", "compute_step_s": 1.0, "bytes_per_step": 1e6}
    lines = [
        {"bandwidth": "100mbit", "codec": "dense", "mean_step_s": 8.0, **fields},
        {"bandwidth": "100mbit", "codec": "fft", "mean_step_s": 2.0, **fields},
    ]
    (tmp_path / "network.partial.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    argv = ["bench", "network", "--bandwidth", "100mbit", "--models", "fc-heavy"]
    assert main([*argv, "--codecs", "dense,fft", "--from-partial", "--out", str(tmp_path)]) == 0
    body = json.loads((tmp_path / "network.json").read_text())
    assert [r["speedup_vs_dense"] for r in body["records"]] == [1.0, 4.0]
    assert "Interrupted run" in body["note"]
    assert "fft 4.00x dense (target >= 4.0x: met)" in (tmp_path / "network.md").read_text()


def test_scale_lines_judge_bytes_and_step_targets_across_world_sizes() -> None:
    from superneurons.bench.network.scale import exchange_kind, scale_lines

    def kind(label: str) -> str:
        return exchange_kind(parse_spec(label))

    assert [kind(c) for c in ("dense", "torch-fp16", "bf16", "powersgd:rank=4")] == [
        "dense",
        "anchor",
        "ring",
        "ring",
    ]
    assert kind("twophase:bits=4") == "twophase" and kind("torch-powersgd:rank=4") == "anchor"
    assert kind("ef(ctopk)") == "gather" and kind("auto") == "auto"
    assert exchange_kind(None) == "unknown"  # a label the configuration does not name

    def record(p: int, codec: str, received: float, step_s: float) -> dict[str, object]:
        return {"bandwidth": "1gbit", "model": "fc-heavy", "status": "ok", "nproc": p,
                "codec": codec, "bytes_received_per_rank": received, "mean_step_s": step_s}  # fmt: skip

    records = [
        record(2, "twophase:bits=4", 100.0, 1.0),
        record(8, "twophase:bits=4", 105.0, 1.0),
        record(2, "ctopk", 10.0, 1.0),
        record(8, "ctopk", 70.0, 1.3),
        record(8, "torch-fp16", 400.0, 1.6),
        record(8, "auto", 50.0, 1.02),
    ]
    compressions = {c: parse_spec(c) for c in ("twophase:bits=4", "ctopk", "torch-fp16", "auto")}
    lines = scale_lines(records, compressions)
    assert any("twophase:bits=4" in ln and "1.05x; target within 10%: met" in ln for ln in lines)
    assert any("predict 2(P-1)/P: 1.75x" in ln for ln in lines)
    assert any(
        "ctopk" in ln and "7.00x; all-gather predicts (P-1) growth: 7.00x" in ln for ln in lines
    )
    best = next(ln for ln in lines if "best two-phase" in ln)
    assert "1.60x torch-fp16 (target >= 1.5x: met)" in best
    assert "1.30x the best all-gather codec ctopk (target >= 1.2x: met)" in best
    assert any(
        "auto 1.020 s/step, 0.98x the best fixed choice" in ln and ": met)" in ln for ln in lines
    )
    records[1]["bytes_received_per_rank"] = 120.0
    assert any(
        "1.20x; target within 10%: NOT met" in ln for ln in scale_lines(records, compressions)
    )


def test_extrapolation_sets_measured_beside_predicted_and_says_what_auto_would_choose(
    tmp_path: Path,
) -> None:
    from superneurons.bench.network.extrapolate import extrapolation, write_extrapolation
    from superneurons.strategy import DENSE, BucketTiming, CodecCost, DecisionInputs, ring_network

    def inputs(p: int) -> dict[str, object]:
        costs = [DENSE] + [
            CodecCost(parse_spec(s), s != "ctopk", 1e-10, 1e-10, bits, 0.1)  # type: ignore[arg-type]
            for s, bits in (("bf16", 16.0), ("ctopk", 1.1))
        ]
        made = DecisionInputs(
            buckets=(BucketTiming("fc", ("fc.weight",), 25_000_000, 0.05),),
            costs=tuple(costs),
            backward_s=0.3,
            outside_s=0.1,
            network=ring_network(p, alpha_s=1e-4, bandwidth_bytes_per_s=1.25e8),
            max_rel_error=0.6,
        )
        return made.to_dict()

    def record(p: int, codec: str, step_s: float) -> dict[str, object]:
        return {"bandwidth": "1gbit", "bandwidth_bit_s": 1_000_000_000, "model": "fc-heavy",
                "status": "ok", "nproc": p, "codec": codec, "mean_step_s": step_s,
                **({"sync_inputs": inputs(p)} if codec == "auto" else {})}  # fmt: skip

    labels = ("dense", "ctopk", "auto")
    records = [record(p, c, 1.0) for p in (2, 8) for c in labels]
    compressions = {c: parse_spec(c) for c in labels}
    rows, choices = extrapolation(records, compressions, predict_nprocs=(64,))
    at = {(r["codec"], r["rate_bit_s"], r["nproc"]): r for r in rows}
    assert at[("dense", 1e9, 8)]["measured_step_s"] == 1.0  # measured where it ran ...
    assert at[("dense", 1e10, 8)]["measured_step_s"] is None  # ... and at no other rate
    assert at[("ctopk", 1e9, 64)]["predicted_step_s"] > at[("ctopk", 1e9, 8)]["predicted_step_s"]
    assert at[("twophase:bits=4", 1e9, 8)]["predicted_step_s"] is None  # not a candidate here
    assert at[("dense", 1e11, 64)]["predicted_step_s"] < at[("dense", 1e9, 64)]["predicted_step_s"]
    assert len(choices) == 3 and all("P=64" in line for line in choices)
    paths = write_extrapolation(records, tmp_path, compressions, predict_nprocs=(64, 512))
    assert [p.name for p in paths] == [
        "extrapolation.json",
        "extrapolation.md",
        "extrapolation.png",
    ]
    assert "| fc-heavy | dense | 1 Gbit/s | **1** / " in (tmp_path / "extrapolation.md").read_text()


def test_the_extrapolation_table_names_what_its_labels_parse_to() -> None:
    from superneurons.bench.network.extrapolate import TABLE_CODECS

    assert {label: parse_spec(label) for label in TABLE_CODECS} == TABLE_CODECS


def test_codec_labels_are_parsed_once_per_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The config parses each label once; the reports take its objects; a worker (a process of
    its own) parses its labels once more, when it reads its configuration."""
    from superneurons.bench.network.worker import WorkerConfig

    counts: collections.Counter[str] = collections.Counter()
    check = grammar._check_text

    def counted(text: object) -> None:
        counts[str(text)] += 1
        check(text)

    monkeypatch.setattr(grammar, "_check_text", counted)
    config = _tiny(codecs=("dense", "twophase:bits=4", "auto"))
    assert counts == dict.fromkeys(config.codecs, 1)
    fields = {"model": "fc-heavy", "status": "ok", "compute_step_s": 1.0, "bytes_per_step": 1e6}
    records = [
        {"bandwidth": "1gbit", "nproc": p, "codec": c, "mean_step_s": 1.0, **fields}
        for p in (2, 4)
        for c in config.codecs
    ]
    write_artifacts(records, tmp_path, config)
    assert counts == dict.fromkeys(config.codecs, 1)
    worker = WorkerConfig(0, 2, "127.0.0.1", 1, "mlp", config.codecs)
    assert counts == dict.fromkeys(config.codecs, 2)
    assert worker.compressions == config.compressions


def test_the_load_note_says_whether_other_processes_shared_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from superneurons.bench.network import report

    monkeypatch.setattr(report.os, "cpu_count", lambda: 2)
    quiet = report._load_note([{"load_avg_1m": 1.3}, {"load_avg_1m": 1.9}])
    assert quiet.endswith("1.3 to 1.9 on 2 cores (at or below the core count).")
    busy = report._load_note([{"load_avg_1m": 1.3}, {"load_avg_1m": 4.0}])
    assert "above the core count: other processes shared the CPU" in busy
    assert report._load_note([{"load_avg_1m": None}]) == ""
