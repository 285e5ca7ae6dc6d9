"""Rounds of the network benchmark: alternating codec order, each codec's rounds pooled into one
record whose means are over every timed step, and a failed round failing the record."""

from __future__ import annotations

import pytest

from superneurons.bench.network.rounds import order, pool
from superneurons.bench.network.run import NetworkBenchConfig, run_network_bench
from superneurons.errors import ConfigError


def _round(step_s: list[float], cpu_s: list[float], **extra: object) -> dict[str, object]:
    return {
        "status": "ok",
        "codec": "ctopk",
        "steps": len(step_s),
        "mean_step_s": sum(step_s) / len(step_s),
        "cpu_step_s": sum(cpu_s) / len(cpu_s),
        "step_s_each": step_s,
        "cpu_step_s_each": cpu_s,
        "bytes_per_step": 100.0,
        "bytes_received_per_rank": None,
        "compute_step_s": 0.2,
        "compute_cpu_s": 0.19,
        "first_loss": 2.3,
        "last_loss": 2.0,
        "attempts": 1,
        **extra,
    }


def test_odd_rounds_run_the_codecs_backwards() -> None:
    codecs = ("dense", "torch-fp16", "ctopk")
    assert [order(codecs, r) for r in range(3)] == [codecs, codecs[::-1], codecs]


def test_one_round_is_the_record_unchanged() -> None:
    first = _round([0.5, 0.7], [0.4, 0.6])
    assert pool([first]) == first


def test_pooled_means_are_over_every_timed_step() -> None:
    rounds = [
        _round([0.5, 0.7], [0.4, 0.6], compute_step_s=0.2, bytes_per_step=100.0),
        _round([0.4, 0.4, 0.4], [0.3, 0.3, 0.3], compute_step_s=0.4, bytes_per_step=50.0),
    ]
    rounds[1]["last_loss"] = 1.5
    pooled = pool(rounds)
    every = [0.5, 0.7, 0.4, 0.4, 0.4]
    assert pooled["step_s_each"] == every and pooled["steps"] == 5
    assert pooled["mean_step_s"] == pytest.approx(sum(every) / 5)
    assert pooled["cpu_step_s"] == pytest.approx((0.4 + 0.6 + 0.9) / 5)
    assert pooled["bytes_per_step"] == pytest.approx((2 * 100 + 3 * 50) / 5)
    assert pooled["compute_step_s"] == pytest.approx(0.3)  # once per launch: per round
    assert pooled["bytes_received_per_rank"] is None  # loopback: not measured in any round
    assert (pooled["first_loss"], pooled["last_loss"]) == (2.3, 1.5)
    assert pooled["attempts"] == 2
    assert [r["mean_step_s"] for r in pooled["rounds"]] == [0.6, pytest.approx(0.4)]


def test_a_failed_round_fails_the_record() -> None:
    failed = {"codec": "ctopk", "status": "failed", "error": "rank 1 (exit 1)", "attempts": 2}
    pooled = pool([_round([0.5], [0.4]), failed, _round([0.5], [0.4])])
    assert pooled["status"] == "failed" and pooled["error"] == "rank 1 (exit 1)"
    assert (pooled["attempts"], pooled["rounds_ok"], pooled["rounds_run"]) == (4, 2, 3)


def test_rounds_are_checked_before_any_rank_starts() -> None:
    with pytest.raises(ConfigError, match="--rounds must be >= 1"):
        NetworkBenchConfig(rounds=0)
    with pytest.raises(ConfigError, match="each codec once"):
        NetworkBenchConfig(rounds=2, codecs=("dense", "ctopk", "ctopk"))


@pytest.mark.dist
def test_two_loopback_rounds_pool_each_codec() -> None:
    config = NetworkBenchConfig(
        bandwidths_bit_s=(None,),
        models={"mlp": {"hidden": [16]}},
        codecs=("dense", "torch-fp16"),
        warmup_steps=2,
        steps=2,
        compute_steps=1,
        batch_size=8,
        shaping=False,
        rounds=2,
    )
    said: list[str] = []
    records = run_network_bench(config, progress=said.append)
    assert [r["codec"] for r in records] == ["dense", "torch-fp16"]
    assert [m for m in said if "round" in m] == ["  mlp: round 1 of 2", "  mlp: round 2 of 2"]
    for record in records:
        assert record["status"] == "ok", record.get("error")
        assert record["steps"] == 4 and len(record["step_s_each"]) == 4
        assert len(record["rounds"]) == 2
        mean = sum(r["mean_step_s"] for r in record["rounds"]) / 2
        assert record["mean_step_s"] == pytest.approx(mean)
    assert records[0]["speedup_vs_dense"] == pytest.approx(1.0)
