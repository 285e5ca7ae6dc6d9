"""The bandwidth benchmark: data-parallel step time of every codec over real shaped links.

For each world size and bandwidth, :func:`run_network_bench` creates one network namespace
per rank joined by veth links rate-limited with tbf (:mod:`superneurons.bench.links`; more
than 2 ranks share a bridge), measures the link's TCP goodput once, and for each (model,
codec) starts one process per rank inside its namespace (:mod:`.worker`: gloo over the veth,
one thread per rank). Each record says the mean step
time after warm-up, the speedup over plain DDP at the same bandwidth, world size and model,
bytes sent and received per rank per step, and the compute-only step time for reference.

Why compression may not pay (Wang et al., HPDC'20: 2.26x for FFT on 8 GPUs): gathered payloads
cost each rank ``(P-1) S / CR`` vs ``2 (P-1)/P S`` for a ring (gathering wins only when
``CR > P/2``), and on a CPU the encode/decode can exceed the wire time it saves.

A bandwidth of ``None`` (``--bandwidth loopback``) runs the ranks on loopback, unshaped;
``shaping=False`` runs every setting that way (no root): codec cost, not a network.

``rounds`` above 1 launches the ranks that many times per (link, model), the codecs in
alternating order, and pools each codec's timed steps (:mod:`.rounds`): on a shared machine,
drift then falls on every codec alike.

``auto`` (:mod:`superneurons.schemes.auto`) is one more codec here; its worker extends the
untimed warm-up until its first decision is made, so the timed steps measure the decision.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from superneurons.bench.links.netns import (
    Topology,
    measure_throughput_bit_s,
    network_namespaces,
)
from superneurons.bench.network.data import DATA_CHOICES
from superneurons.bench.network.rounds import order, pool
from superneurons.data.fashion_mnist import DEFAULT_ROOT as FASHION_MNIST_ROOT
from superneurons.errors import ConfigError
from superneurons.rates import format_rate
from superneurons.schemes.grammar import Compression, parse_spec
from superneurons.train.launch import free_port

__all__ = [
    "ALL_CODECS",
    "DEFAULT_MODELS",
    "NetworkBenchConfig",
    "add_speedups",
    "config_dict",
    "run_network_bench",
]

log = logging.getLogger("superneurons.bench.network")

# PyTorch's own hooks are the anchors; ours follow. "dense" is plain DDP (no hook).
ALL_CODECS: tuple[str, ...] = (
    "dense",
    "torch-fp16",
    "torch-powersgd:rank=4",
    "fft",
    "topk",
    "qsgd",
    "terngrad",
    "signsgd",
    "powersgd:rank=4",
    "auto",
)
# FC-heavy: 30.0M parameters, 97% in the FC head (a big gradient, a cheap step); the conv model
# is a narrow ResNet-18 for 28x28x1 inputs, where convolutions dominate compute.
DEFAULT_MODELS: dict[str, dict[str, Any]] = {
    "fc-heavy": {},
    "resnet": {"depth": 18, "small_input": True, "in_channels": 1, "num_classes": 10, "width": 32},
}
Progress = Callable[[str], None]


@dataclass(frozen=True)
class NetworkBenchConfig:
    """What to measure. ``bandwidths_bit_s`` entries are link rates; ``None`` = unshaped."""

    bandwidths_bit_s: tuple[int | None, ...] = (100_000_000, 1_000_000_000)
    nprocs: tuple[int, ...] = (2,)  # world sizes, each a run of its own
    predict_nprocs: tuple[int, ...] = (64, 512)  # predicted by the report from auto's inputs
    models: dict[str, dict[str, Any]] = field(default_factory=lambda: dict(DEFAULT_MODELS))
    codecs: tuple[str, ...] = ALL_CODECS
    batch_size: int = 32
    warmup_steps: int = 2
    steps: int = 5
    compute_steps: int = 3
    # launches per (link, model), the codecs in alternating order, pooled (bench.network.rounds)
    rounds: int = 1
    shaping: bool = True
    measure_link: bool = True
    run_timeout_s: float = 900.0
    # "real": Fashion-MNIST for the models that take it (bench.network.data), else "random"
    data: str = "real"
    data_root: str = FASHION_MNIST_ROOT

    def __post_init__(self) -> None:
        if self.data not in DATA_CHOICES:
            raise ConfigError(f"--data must be one of {', '.join(DATA_CHOICES)}, got {self.data!r}")
        if not self.nprocs or min(self.nprocs) < 2 or len(set(self.nprocs)) < len(self.nprocs):
            raise ConfigError(f"--nproc: distinct world sizes >= 2, got {list(self.nprocs)}")
        if not self.bandwidths_bit_s:
            raise ConfigError("give at least one bandwidth, e.g. --bandwidth 100mbit")
        if not self.codecs or not self.models:
            raise ConfigError("give at least one codec and one model")
        if self.steps < 1 or self.warmup_steps < 0 or self.compute_steps < 0:
            raise ConfigError("--steps must be >= 1 and --warmup >= 0")
        if self.codecs.count("dense") > 1:
            raise ConfigError("list 'dense' at most once")
        if self.rounds < 1:
            raise ConfigError(f"--rounds must be >= 1, got {self.rounds}")
        if self.rounds > 1 and len(set(self.codecs)) < len(self.codecs):
            raise ConfigError("with --rounds above 1, list each codec once (rounds pool by label)")
        self.compressions  # noqa: B018  (parses every codec now, before any rank starts)

    @cached_property
    def compressions(self) -> dict[str, Compression]:
        """Each codec label parsed once (what the reports classify; every rank parses its
        labels once more, in its own process)."""
        return {label: parse_spec(label) for label in self.codecs}


@dataclass(frozen=True)
class _Link:
    """Where the ranks run: a shaped topology, or loopback."""

    topology: Topology | None
    measured_bit_s: float | None

    def prefix(self, rank: int) -> list[str]:
        return self.topology.exec_prefix(rank) if self.topology else []

    def master_addr(self) -> str:
        return self.topology.addresses[0] if self.topology else "127.0.0.1"

    def ifname(self, rank: int) -> str:
        return self.topology.interfaces[rank] if self.topology else "lo"


@contextmanager
def _link(
    config: NetworkBenchConfig, rate_bit_s: int | None, nproc: int, say: Progress
) -> Iterator[_Link]:
    if not config.shaping or rate_bit_s is None:  # loopback, unshaped
        yield _Link(None, None)
        return
    with network_namespaces(nproc, rate_bit_s=rate_bit_s) as topology:
        measured = measure_throughput_bit_s(topology) if config.measure_link else None
        if measured is not None:
            say(f"link {format_rate(rate_bit_s or 0)}: measured {measured / 1e6:.0f} Mbit/s TCP")
        yield _Link(topology, measured)


def _measure(
    config: NetworkBenchConfig, link: _Link, nproc: int, model: str, workdir: Path, say: Progress
) -> Iterator[dict[str, Any]]:
    """Every codec's record on ``model``: one launch of the ranks (as soon as each codec is
    measured), or with ``config.rounds`` above 1, each codec's rounds pooled (after the last
    round; :mod:`superneurons.bench.network.rounds`), in the order of ``config.codecs``."""
    if config.rounds == 1:
        yield from _run_codecs(config, link, nproc, model, config.codecs, workdir, say)
        return
    results: dict[str, list[dict[str, Any]]] = {codec: [] for codec in config.codecs}
    for index in range(config.rounds):
        say(f"  {model}: round {index + 1} of {config.rounds}")
        codecs = order(config.codecs, index)
        for result in _run_codecs(config, link, nproc, model, codecs, workdir, say):
            results[result["codec"]].append(result)
    for codec in config.codecs:
        yield pool(results[codec])


def _run_codecs(
    config: NetworkBenchConfig,
    link: _Link,
    nproc: int,
    model: str,
    codecs: Sequence[str],
    workdir: Path,
    say: Progress,
) -> Iterator[dict[str, Any]]:
    """Measure ``codecs`` on ``model``: one worker per rank runs the codecs in turn. If the
    ranks fail (a crash, or a hang past the timeout), fresh ranks retry the codec they were
    on once; a second failure is recorded (with the ranks' last log lines) and fresh ranks
    carry on with the codecs after it. Yields one record per codec as soon as it is known."""
    remaining = list(codecs)
    retried: set[str] = set()
    while remaining:
        say(f"  {model}: {', '.join(remaining)}")
        done, error = _run_ranks(config, link, nproc, model, tuple(remaining), workdir)
        for record in done:
            result = {"status": "ok", **record, "attempts": 1 + (record["codec"] in retried)}
            say(_describe(result))
            yield result
        remaining = remaining[len(done) :]
        if error is None or not remaining:
            continue
        codec = remaining[0]
        if codec not in retried:  # NOTE: torch's PowerSGD hook crashes at random on gloo
            retried.add(codec)  # with several buckets: one retry
            say(f"    {codec}: ranks failed, retrying once ({error[:200]})")
            continue
        result = {"codec": codec, "status": "failed", "error": error, "attempts": 2}
        say(_describe(result))
        yield result
        remaining = remaining[1:]


def _run_ranks(
    config: NetworkBenchConfig,
    link: _Link,
    nproc: int,
    model: str,
    codecs: tuple[str, ...],
    workdir: Path,
) -> tuple[list[dict[str, Any]], str | None]:
    """Start one worker per rank; returns the records of the codecs they finished and, if
    they failed, an error summary."""
    out = workdir / f"rank0-{time.monotonic_ns()}.jsonl"
    port = 29500 + int(time.monotonic_ns() % 400) if link.topology else free_port()
    with ExitStack() as stack:
        procs, logs = [], []
        for rank in range(nproc):
            worker = {
                "rank": rank,
                "world_size": nproc,
                "master_addr": link.master_addr(),
                "master_port": port,
                "model": model,
                "model_kwargs": config.models[model],
                "codecs": list(codecs),
                "batch_size": config.batch_size,
                "warmup_steps": config.warmup_steps,
                "steps": config.steps,
                "compute_steps": config.compute_steps,
                "data": config.data,
                "data_root": config.data_root,
                "out": str(out) if rank == 0 else "",
            }
            env = {**os.environ, "GLOO_SOCKET_IFNAME": link.ifname(rank), "OMP_NUM_THREADS": "1"}
            log_file = stack.enter_context(tempfile.TemporaryFile(mode="w+", dir=workdir))
            argv = [sys.executable, "-m", "superneurons.bench.network.worker", json.dumps(worker)]
            procs.append(
                subprocess.Popen(
                    [*link.prefix(rank), *argv], env=env, stdout=log_file, stderr=subprocess.STDOUT
                )
            )
            logs.append(log_file)
        timeout_s = config.run_timeout_s * len(codecs)
        codes = _wait_all(procs, timeout_s=timeout_s)
        done = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        if not any(codes) and len(done) == len(codecs):
            return done, None
        tails = []
        for rank, log_file in enumerate(logs):
            log_file.seek(0)
            lines = [ln for ln in log_file.read().splitlines() if ln.strip()]
            tails.append(f"rank {rank} (exit {codes[rank]}): " + " | ".join(lines[-3:]))
        return done, "; ".join(tails)[-1500:]


def _wait_all(procs: Sequence[subprocess.Popen[bytes]], *, timeout_s: float) -> list[int]:
    """Wait for every rank; once one fails (or time is up) kill the others, which would
    otherwise block in a collective until gloo's timeout."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = [proc.poll() for proc in procs]
            if all(code is not None for code in codes):
                return [int(code or 0) for code in codes]
            if any(code not in (None, 0) for code in codes) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:  # also on Ctrl-C: never leave ranks running inside namespaces being deleted
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return [int(proc.wait()) for proc in procs]


def _done(record: dict[str, Any]) -> bool:
    return record.get("status") == "ok" and bool(record.get("mean_step_s"))


def _setting(record: dict[str, Any]) -> tuple[Any, ...]:
    """What a record is compared within: the same bandwidth, world size and model."""
    return record["bandwidth"], record.get("nproc", 2), record["model"]


def add_speedups(records: list[dict[str, Any]]) -> None:
    """Set ``speedup_vs_dense`` = dense step time / this step time, per (bandwidth, model)."""
    dense = {_setting(r): r["mean_step_s"] for r in records if r["codec"] == "dense" and _done(r)}
    for record in records:
        base = dense.get(_setting(record))
        step_s = record.get("mean_step_s")
        ok = base is not None and isinstance(step_s, float) and step_s > 0
        record["speedup_vs_dense"] = base / step_s if ok else None  # type: ignore[operator]


def add_predictions(records: list[dict[str, Any]]) -> None:
    """Set ``predicted_train_step_s``: what the default ``auto`` record's cost model predicted
    for this record's route at the same bandwidth and model, a whole step (the assignment's
    ``by_spec`` from backward's start plus its measured ``outside_s``); the ``auto`` records
    get their own decision's. None where auto did not measure that codec."""
    autos = {
        _setting(r): r["sync_assignment"]
        for r in records
        if r["codec"] == "auto" and r.get("status") == "ok" and r.get("sync_assignment")
    }
    for record in records:
        own = record.get("sync_assignment")
        by_auto = autos.get(_setting(record))
        predicted = None
        if own and "predicted_train_step_s" in own:
            predicted = own["predicted_train_step_s"]
        elif by_auto and record["codec"] in by_auto.get("by_spec", {}):
            predicted = by_auto["by_spec"][record["codec"]] + by_auto.get("outside_s", 0.0)
        record["predicted_train_step_s"] = predicted


def add_breakdown(records: list[dict[str, Any]]) -> None:
    """Split each step: ``wire_s_est`` = bytes per step over the measured link goodput (the
    rank's interface bytes, the larger direction, where measured: a gathered payload or an
    all-to-all segment crosses the wire P - 1 times, which ``bytes_per_step`` does not say),
    ``other_s`` = step - compute-only - wire (encode/decode, synchronisation, waiting for the
    peer; negative when communication overlaps backward); ``idle_step_s_est`` = CPU seconds
    per step + wire, and ``idle_speedup_est`` its ratio to dense's."""
    for record in records:
        link = record.get("measured_link_bit_s")
        ok = record.get("status") == "ok" and link
        on_wire = [record.get("bytes_received_per_rank"), record.get("bytes_sent_wire_per_rank")]
        nbytes = max(b for b in on_wire if b) if any(on_wire) else record.get("bytes_per_step")
        wire_s = nbytes * 8 / link if ok and nbytes is not None else None
        record["wire_s_est"] = wire_s
        # comm_s: what communication adds, the step minus the compute-only step
        comm_s = record["mean_step_s"] - record["compute_step_s"] if _done(record) else None
        record["comm_s"] = comm_s
        record["other_s"] = comm_s - wire_s if wire_s is not None and comm_s is not None else None
        # NOTE: an estimate for a machine where each rank has a core to itself: the rank's CPU
        # seconds per step (compute, encode/decode, gloo threads; no waiting) plus the wire
        # time, with no overlap between them (so an upper bound when backward hides the wire).
        cpu_s = record.get("cpu_step_s")
        record["idle_step_s_est"] = cpu_s + wire_s if wire_s is not None and cpu_s else None
    dense = {
        _setting(r): r["idle_step_s_est"]
        for r in records
        if r["codec"] == "dense" and r.get("idle_step_s_est")
    }
    for record in records:
        base = dense.get(_setting(record))
        est = record.get("idle_step_s_est")
        record["idle_speedup_est"] = base / est if base and est else None


def run_network_bench(
    config: NetworkBenchConfig,
    *,
    progress: Progress | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Measure every (bandwidth, model, codec); returns one record per run (failures included,
    with ``status="failed"`` and the ranks' last log lines). ``on_record`` sees each record
    as soon as it is measured (e.g. to save partial results of a long run)."""
    say = progress or log.info
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sn-network-") as tmp:
        for nproc in config.nprocs:
            for rate_bit_s in config.bandwidths_bit_s:
                bandwidth = format_rate(rate_bit_s) if rate_bit_s else "loopback"
                say(f"== {bandwidth}, {nproc} ranks ==")
                with _link(config, rate_bit_s, nproc, say) as link:
                    for model in config.models:
                        for result in _measure(config, link, nproc, model, Path(tmp), say):
                            records.append(
                                {
                                    "bandwidth": bandwidth,
                                    "bandwidth_bit_s": rate_bit_s,
                                    "measured_link_bit_s": link.measured_bit_s,
                                    "nproc": nproc,
                                    "model": model,
                                    "model_kwargs": config.models[model],
                                    **result,
                                    "load_avg_1m": os.getloadavg()[0],
                                }
                            )
                            if on_record is not None:
                                on_record(records[-1])
    add_speedups(records)
    add_breakdown(records)
    add_predictions(records)
    return records


def _describe(record: dict[str, Any]) -> str:
    if record.get("status") != "ok":
        return f"    {record['codec']}: FAILED {record.get('error', '')[:300]}"
    return (
        f"    {record['codec']}: step {record['mean_step_s']:.3f} s (compute {record['compute_step_s']:.3f} s), "
        f"{record['bytes_per_step'] / 1e6:.2f} MB/step, loss {record['first_loss']:.3f} -> "
        f"{record['last_loss']:.3f}"
    )


def config_dict(config: NetworkBenchConfig) -> dict[str, Any]:
    """The config as JSON-ready data for the artifact (``nproc``: the world size, or the list
    of them when several were run)."""
    data = asdict(config)
    nprocs = data.pop("nprocs")
    data["nproc"] = nprocs[0] if len(nprocs) == 1 else list(nprocs)
    return data
