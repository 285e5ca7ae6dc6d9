"""The convergence benchmark's records and artifacts, from a tiny real 2-rank run."""

from __future__ import annotations

import collections
import json
import math
import os
import pickle
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from superneurons.bench.convergence.config import FASHION_MNIST, SHAKESPEARE, ConvergenceConfig
from superneurons.bench.convergence.labels import read_label
from superneurons.bench.convergence.report import summary_lines, write_artifacts
from superneurons.bench.convergence.run import add_deltas, run_convergence_bench
from superneurons.codecs.schedule import DiminishingTheta, Scheduled
from superneurons.errors import ConfigError
from superneurons.schemes import grammar
from superneurons.schemes.adam import AdamAuto, AdamUpdate
from superneurons.schemes.auto import Auto
from superneurons.schemes.grammar import parse_spec
from superneurons.schemes.theta import Diminishing, RunScheduled
from train_support import STATED_COMPUTE

FMNIST_ROOT = Path(ConvergenceConfig().fashion_mnist_root)
SHAKESPEARE_ROOT = Path(__file__).resolve().parents[1] / "data" / "shakespeare"


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.skipif(
    not (FMNIST_ROOT / "t10k-labels-idx1-ubyte.gz").exists()
    or not any(SHAKESPEARE_ROOT.glob("*.txt")),
    reason="needs Fashion-MNIST and the Shakespeare texts (bash scripts/setup.sh)",
)
def test_tiny_run_records_curves_and_artifacts(tmp_path: Path) -> None:
    config = ConvergenceConfig(
        codecs=("dense", "fft"),
        tasks=(
            replace(
                FASHION_MNIST,
                epochs=1,
                train_limit=256,
                batch_size=32,
                eval_points=2,
                eval_limit=300,
            ),
            replace(SHAKESPEARE, steps=3, batch_size=4, eval_points=1, eval_limit=8),
        ),
        shakespeare_root=str(SHAKESPEARE_ROOT),
    )
    records = run_convergence_bench(config, progress=lambda _m: None)
    assert [(r["task"], r["codec"]) for r in records] == [
        ("fashion-mnist", "dense"),
        ("fashion-mnist", "fft"),
        ("shakespeare", "dense"),
        ("shakespeare", "fft"),
    ]
    fmnist_dense, fmnist_fft, lm_dense, lm_fft = records
    assert fmnist_dense["steps"] == 256 // 2 // 32  # one epoch of each rank's shard
    assert [p[0] for p in fmnist_dense["curve"]] == [2, 4]
    assert 0.0 <= fmnist_fft["final_metric"] <= 100.0
    assert fmnist_dense["delta_vs_dense"] == 0.0
    assert fmnist_fft["delta_vs_dense"] == pytest.approx(
        fmnist_fft["final_metric"] - fmnist_dense["final_metric"]
    )
    assert lm_dense["metric"] == "val_loss_nats" and math.isfinite(lm_fft["final_metric"])
    assert 0 < fmnist_fft["bytes_sent_per_step"] < 4 * 0.6e6  # compressed below dense fp32

    paths = write_artifacts(records, tmp_path, config)
    assert {p.name for p in paths} == {"convergence.json", "convergence.md", "convergence.png"}
    assert len(json.loads((tmp_path / "convergence.json").read_text())["records"]) == 4


def test_deltas_are_per_task() -> None:
    records = [
        {"task": "a", "codec": "dense", "final_metric": 90.0},
        {"task": "a", "codec": "fft", "final_metric": 89.5},
        {"task": "b", "codec": "fft", "final_metric": 2.0},
    ]
    add_deltas(records)
    assert [r["delta_vs_dense"] for r in records] == [0.0, -0.5, None]


def test_config_needs_dense_reference_and_known_codecs() -> None:
    with pytest.raises(ConfigError, match="dense"):
        ConvergenceConfig(codecs=("fft",))
    with pytest.raises(ConfigError):
        ConvergenceConfig(codecs=("dense", "no-such-codec"))


def test_codec_labels_are_checked_before_any_rank_starts() -> None:
    ConvergenceConfig(
        codecs=(
            "dense",
            "auto",
            "adam-update[warmup=10]:signsgd",
            "adam-momentum[warmup=20,wire=fp16]:signsgd",
            "fft|diminishing:start=0.999,floor=0.9,drops=1,until=0.5",
        )
    )
    with pytest.raises(ConfigError, match="diminishing"):
        ConvergenceConfig(codecs=("dense", "fft|cosine:start=0.9"))
    with pytest.raises(ConfigError, match="unknown codec"):
        ConvergenceConfig(codecs=("dense", "adam-update:nope"))
    with pytest.raises(ConfigError, match="until"):
        ConvergenceConfig(codecs=("dense", "fft|diminishing:until=2"))
    with pytest.raises(ConfigError, match="no θ to schedule"):
        ConvergenceConfig(codecs=("dense", "qsgd|diminishing"))
    with pytest.raises(ConfigError, match="'dense'"):
        ConvergenceConfig(codecs=("dense", "every-step"))


def test_a_theta_schedule_over_the_run_is_read_once_and_set_when_the_length_is_known() -> None:
    label = read_label("fft:theta=0.999|diminishing:start=0.999,floor=0.9,drops=1,until=0.5")
    fft = parse_spec("fft:theta=0.999")
    expected = RunScheduled(fft, Diminishing(start=0.999, floor=0.9, drops=1, until=0.5))
    assert label.on("sgd") == label.on("adamw") == expected
    assert expected.at(468) == Scheduled(fft, DiminishingTheta(0.999, 0.9, steps=234, drops=1))
    assert read_label(str(expected)).on("sgd") == expected  # the spec reads back


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.skipif(not any(SHAKESPEARE_ROOT.glob("*.txt")), reason="needs the Shakespeare texts")
def test_update_compression_counts_bytes_with_warmup() -> None:
    config = ConvergenceConfig(
        codecs=("dense", "adam-update[warmup=1]:signsgd"),
        tasks=(replace(SHAKESPEARE, steps=3, batch_size=4, eval_points=1, eval_limit=8),),
        shakespeare_root=str(SHAKESPEARE_ROOT),
    )
    dense, update = run_convergence_bench(config, progress=lambda _m: None)
    assert dense["ratio_vs_dense"] == 1.0 and math.isfinite(update["final_metric"])
    # 1 dense step (fp32) + 2 one-bit steps: a ratio just under 3
    per_step = update["dense_bytes_per_step"]
    assert per_step * 3 / update["ratio_vs_dense"] == pytest.approx(
        update["bytes_sent_per_step"] * 3
    )
    assert 2.5 < update["ratio_vs_dense"] < 3.0


def test_adam_auto_labels_run_on_adam_tasks_only() -> None:
    ConvergenceConfig(codecs=("dense", "auto:link=100mbit", "auto:margin=0.1"))
    with pytest.raises(ConfigError, match="link"):
        ConvergenceConfig(codecs=("dense", "auto:link=fast"))
    assert read_label("auto:link=100mbit").on("adamw") == AdamAuto(link_bit_s=100_000_000)
    assert read_label("auto").on("adamw") == AdamAuto()
    assert read_label("auto").on("sgd") == Auto()  # SGD: the gradient hook's auto
    assert read_label("auto:observe_steps=3").on("sgd") == Auto(observe_steps=3)
    assert read_label("auto:observe_steps=3").on("adamw") is None  # the hook's auto options
    assert read_label("auto:link=100mbit").on("sgd") is None
    assert read_label("adam-update:fp16").on("sgd") is None  # the optimizer communicates
    assert isinstance(read_label("adam-update:fp16").on("adam"), AdamUpdate)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.skipif(not any(SHAKESPEARE_ROOT.glob("*.txt")), reason="needs the Shakespeare texts")
def test_adam_auto_records_its_decision_and_trains_as_the_chosen_scheme() -> None:
    one_bit = "adam-momentum[warmup=20,wire=fp16]:signsgd"  # auto's scheme for 3 steps
    config = ConvergenceConfig(
        codecs=("dense", "auto:link=1000gbit", "auto:link=10kbit", one_bit),
        tasks=(replace(SHAKESPEARE, steps=3, batch_size=4, eval_points=1, eval_limit=8),),
        shakespeare_root=str(SHAKESPEARE_ROOT),
        adam_compute=STATED_COMPUTE,  # the decision depends on its inputs, not on the load
    )
    dense, fast, slow, fixed = run_convergence_bench(config, progress=lambda _m: None)
    assert dense["decision"] is None and fixed["decision"] is None
    for auto in (fast, slow):  # nothing measured entered
        assert auto["decision"]["backward_s"] == STATED_COMPUTE.backward_s
    assert fast["decision"]["scheme"] == "dense" and slow["decision"]["scheme"] == one_bit
    assert "stated" in slow["decision"]["link"]
    assert fast["final_metric"] == dense["final_metric"] and fast["ratio_vs_dense"] == 1.0
    assert slow["final_metric"] == fixed["final_metric"]
    assert slow["ratio_vs_dense"] == fixed["ratio_vs_dense"] > 1.0


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.netns
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("tc") is None or not any(SHAKESPEARE_ROOT.glob("*.txt")),
    reason="needs root with ip and tc, and the Shakespeare texts",
)
def test_shaped_link_trains_the_same_steps_between_namespaces() -> None:
    config = ConvergenceConfig(
        codecs=("dense", "auto"),
        tasks=(replace(SHAKESPEARE, steps=3, batch_size=4, eval_points=1, eval_limit=8),),
        shakespeare_root=str(SHAKESPEARE_ROOT),
        bandwidth_bit_s=100_000_000,
    )
    dense, auto = run_convergence_bench(config, progress=lambda _m: None)
    assert math.isfinite(dense["final_metric"]) and auto["decision"]["link"] == "measured"
    # the link really is shaped: the fitted all-reduce moves at most ~100 Mbit/s
    assert auto["decision"]["network"]["all_reduce"]["beta_s_per_byte"] > 8 / 120e6


def test_diloco_labels_name_diloco_with_error_feedback_on_a_lossy_wire() -> None:
    from superneurons.codecs.feedback import ErrorFeedback
    from superneurons.codecs.qsgd import QSGDCodec
    from superneurons.schemes.diloco import DiLoCo

    label = read_label("diloco[steps=4]:qsgd")
    assert label.on("adamw") == label.on("sgd") == DiLoCo(ErrorFeedback(QSGDCodec()), 4)
    assert read_label("diloco:steps=4").on("sgd") == DiLoCo(steps=4)
    with pytest.raises(ConfigError, match="steps"):
        ConvergenceConfig(codecs=("dense", "diloco:steps=0"))


def test_time_to_loss_interpolates_between_curve_points() -> None:
    from superneurons.bench.convergence.report import time_to_loss_s

    record = {"curve": [[10, 3.0], [20, 2.6], [30, 2.5]], "curve_train_s": [5.0, 9.0, 13.0]}
    assert time_to_loss_s(record, 3.1) == 5.0  # the first point already
    assert time_to_loss_s(record, 2.8) == pytest.approx(7.0)  # halfway from 3.0 to 2.6
    assert time_to_loss_s(record, 2.5) == pytest.approx(13.0)
    assert time_to_loss_s(record, 2.4) is None
    assert time_to_loss_s({"curve": record["curve"]}, 2.8) is None  # an untimed record


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.skipif(not any(SHAKESPEARE_ROOT.glob("*.txt")), reason="needs the Shakespeare texts")
def test_diloco_counts_its_rounds_bytes_and_times_its_curve() -> None:
    config = ConvergenceConfig(
        codecs=("dense", "diloco[steps=2]:fp16"),
        tasks=(replace(SHAKESPEARE, steps=5, batch_size=4, eval_points=2, eval_limit=8),),
        shakespeare_root=str(SHAKESPEARE_ROOT),
    )
    dense, diloco = run_convergence_bench(config, progress=lambda _m: None)
    # rounds after steps 2, 4 and 5 (the run's end), fp16 (2 bytes) against fp32 every step
    assert diloco["ratio_vs_dense"] == pytest.approx(5 * 4 / (3 * 2))
    assert len(diloco["curve_train_s"]) == len(diloco["curve"]) == 2
    assert 0 < diloco["curve_train_s"][0] < diloco["curve_train_s"][1]
    assert math.isfinite(diloco["final_metric"]) and dense["ratio_vs_dense"] == 1.0


def test_labels_are_read_at_the_edge_and_never_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The config reads each label once per optimizer family; the tasks, the ranks (a pickled
    copy, as a shaped rank reads it) and the report take the objects and parse nothing."""
    counts: collections.Counter[str] = collections.Counter()
    check = grammar._check_text

    def counted(text: object) -> None:
        counts[str(text)] += 1
        check(text)

    monkeypatch.setattr(grammar, "_check_text", counted)
    labels = ("dense", "fft|diminishing:until=0.5", "auto", "adam-update:signsgd")
    config = ConvergenceConfig(codecs=(*labels, "diloco[steps=2]:fp16"))
    assert counts == {"dense": 2, "fft": 2, "auto": 2, "adam-update:signsgd": 2, "fp16": 2}
    read = counts.copy()
    for task in config.tasks:
        assert [lb.on(task.optimizer) is not None for lb in config.labels].count(False) == (
            1 if task.optimizer == "sgd" else 0  # adam-update replaces Adam: not on SGD
        )
    records = [
        {"task": "shakespeare", "codec": text, "final_metric": 2.0, "delta_vs_dense": 0.0}
        for text in config.codecs
    ]
    summary_lines(records, pickle.loads(pickle.dumps(config)))
    assert counts == read


def test_every_label_in_the_recorded_results_still_reads() -> None:
    """The spellings the recorded runs used (``fft:theta=0.999|diminishing:...`` among them)
    read as the one grammar's RUN, and print back to what reads the same."""
    root = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    texts = {
        record["codec"]
        for path in root.rglob("convergence.json")
        for record in json.loads(path.read_text())["records"]
    }
    assert any("|diminishing:" in text for text in texts)
    for text in sorted(texts):
        label = read_label(text)
        for optimizer in ("sgd", "adamw"):
            reading = label.on(optimizer)
            if reading is not None:
                assert read_label(str(reading)).on(optimizer) == reading, (text, optimizer)
