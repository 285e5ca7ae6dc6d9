"""Codec and DDP hook throughput against the machine's memory bandwidth, per bucket.

Three measurements in one run, one CPU thread per process (``--device cuda`` times the codecs
alone on a GPU with CUDA events instead, against a device-to-device copy):

1. **Bandwidth**: the best of N ``copy_`` of 30M fp32 values (120 MB, beyond any cache) in
   fp32 bytes per second: the physical limit a one-pass codec can reach. Every rate below is
   in the same unit (fp32 gradient bytes per second) and is given as a fraction of it.
2. **Codecs alone**, per arm (``--arm NAME=SRC``: a source tree, run in its own process, so a
   "before" tree is measured beside this one), at DDP's default bucket (25 MiB = 6,553,600
   values) and at 30M values, best of N thread CPU times: ``encode``; ``decode`` (the average of
   two ranks' payloads written into a bucket, as the hook does: ``decode_mean_into``, or
   ``decode_sum`` then a division where a tree lacks it); ``feedback`` (error feedback's extra
   work: the compensation ``g + r`` and the residual ``c - decode(own payload)``). Two-phase
   candidates are timed by the cost model's own measurement (``strategy.measure_codecs``), which
   runs the hook's stages on one process: ``decode`` is then the owner's stage plus the decode.
3. **The hook, per bucket** (this tree): two gloo ranks on loopback, a model whose one
   parameter is one bucket, ``register_compression(ddp, spec)``; per stage the CPU time of the
   thread that runs it (encode, error feedback, decode, the two-phase stages), the wall time
   from issuing each collective to its completion, and the rest of the hook's CPU time
   (bookkeeping, copies, Python). With ``--profile``, the top operators of one step's hook
   (``torch.profiler``, rank 0).

    python benchmarks/codec_hook_speed.py --arm after=src --arm before=/tmp/before/src \\
        --out benchmarks/results/codec_hook_speed
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import typing
from pathlib import Path
from typing import Any, NoReturn

SPECS = (
    "fft",
    "ctopk",
    "topk",
    "adaptive",
    "qsgd",
    "terngrad",
    "signsgd",
    "rangefloat",
    "fp16",
    "twophase:bits=1",
    "twophase:bits=4",
)
HOOK_SPECS = ("dense", "fp16", "ctopk", "fft", "twophase:bits=4", "twophase:bits=1")
SIZES = (6_553_600, 30_000_000)
BANDWIDTH_NUMEL = 30_000_000


def _best_s(fn: Any, repeats: int, device: str = "cpu") -> float:
    import torch

    fn()
    best = float("inf")
    for _ in range(repeats):
        if device == "cpu":
            start = time.thread_time()
            fn()
            best = min(best, time.thread_time() - start)
        else:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()  # the harness waits; the codecs never do
            best = min(best, begin.elapsed_time(end) / 1e3)
    return best


def bandwidth_gbps(repeats: int, device: str = "cpu") -> float:
    """fp32 bytes copied per second: ``copy_`` of 120 MB, best of ``repeats``."""
    import torch

    source = torch.randn(BANDWIDTH_NUMEL, device=device)
    target = torch.empty_like(source)
    return 4 * BANDWIDTH_NUMEL / _best_s(lambda: target.copy_(source), repeats, device) / 1e9


def _codec_rates(spec: str, numel: int, repeats: int, device: str) -> dict[str, float]:
    import torch

    from superneurons.compress import parse_spec

    codec = parse_spec(spec)
    gen = torch.Generator(device=device).manual_seed(0)
    grad = torch.randn(numel, generator=gen, device=device)
    payload = codec.encode(grad)
    out, slab, residual = (torch.zeros_like(grad) for _ in range(3))
    try:
        from superneurons.codecs.codec import decode_mean_into, subtract_decode
    except ImportError:  # a tree before these existed: the plain composition

        def decode_mean_into(codec, payloads, out, divisor):  # type: ignore[no-untyped-def]
            return torch.div(codec.decode_sum(payloads), divisor, out=out)

        def subtract_decode(codec, payload, target):  # type: ignore[no-untyped-def]
            return torch.sub(target, codec.decode(payload), out=target)

    def encode() -> object:
        return codec.encode(grad)

    def decode() -> object:
        return decode_mean_into(codec, [payload, payload], out, 2)

    def feedback() -> object:
        return subtract_decode(codec, payload, torch.add(grad, residual, out=slab))

    seconds = {
        "encode": _best_s(encode, repeats, device),
        "decode": _best_s(decode, repeats, device),
        "feedback": _best_s(feedback, repeats, device),
    }
    return {name: 4 * numel / s / 1e9 for name, s in seconds.items()}


def _twophase_rates(spec: str, numel: int, repeats: int, device: str) -> dict[str, float]:
    import torch

    from superneurons.schemes.grammar import parse_spec
    from superneurons.strategy.codecs import measure_codecs

    sample = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
    cost = measure_codecs([parse_spec(spec)], sample, repeats=repeats, world_size=2)[-1]
    return {
        "encode": 1 / cost.encode_s_per_byte / 1e9,
        "decode": 1 / cost.decode_s_per_byte / 1e9,
        "feedback": 1 / cost.feedback_s_per_byte / 1e9 if cost.feedback_s_per_byte else 0.0,
    }


def codecs_worker(args: argparse.Namespace) -> None:
    """One arm's codec rates as JSON lines on stdout (run in the arm's tree)."""
    import torch

    torch.set_num_threads(1)
    for numel in args.sizes:
        for spec in args.specs:
            measure = _twophase_rates if spec.startswith("twophase") else _codec_rates
            try:
                rates = measure(spec, numel, args.repeats, args.device)
            except Exception as error:  # noqa: BLE001 - a codec a tree lacks is recorded
                rates = {"error": repr(error)[:200]}
            print(json.dumps({"spec": spec, "numel": numel, **rates}), flush=True)


# ---- the hook, per bucket (this tree) ------------------------------------------------------


class _Stages:
    """Per-stage times of rank 0's hook, gathered by wrapping the functions the hook calls."""

    def __init__(self) -> None:
        self.cpu_s: dict[str, float] = {}
        self.wall_s: dict[str, float] = {}

    def add(self, table: dict[str, float], name: str, seconds: float) -> None:
        table[name] = table.get(name, 0.0) + seconds

    def timed(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)  # DDP reads a hook's signature
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            # a decode runs inline (inside the hook body) when the collective had finished
            where = "" if threading.current_thread() is threading.main_thread() else " (cb)"
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(self.cpu_s, name + where, time.thread_time() - start)

        if name == "hook body":  # resolved annotations: DDP reads the signature (unwrapped)
            fn.__annotations__ = run.__annotations__ = typing.get_type_hints(fn)
        return run

    def collective(self, name: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            issued = time.perf_counter()
            work = fn(*args, **kwargs)
            if work is not None and kwargs.get("async_op"):
                work.get_future().then(
                    lambda _: self.add(self.wall_s, name, time.perf_counter() - issued)
                )
            return work

        return run


def _instrument(stages: _Stages) -> None:
    import superneurons.ddp.hook as hook
    import superneurons.ddp.reduce as reduce
    import superneurons.ddp.twophase as twophase

    hook.compression_hook = stages.timed("hook body", hook.compression_hook)
    for name in ("subtract_decode", "decode_mean_into"):
        setattr(reduce, name, stages.timed(name, getattr(reduce, name)))
    reduce.all_gather_into_tensor = stages.collective("all-gather", reduce.all_gather_into_tensor)
    twophase.all_gather_into_tensor = stages.collective(
        "all-gather", twophase.all_gather_into_tensor
    )
    for name in ("worker_encode", "owner_reduce", "decode_slices"):
        setattr(twophase, name, stages.timed(name, getattr(twophase, name)))


def hook_worker(rank: int, spec: str, numel: int, args: argparse.Namespace) -> NoReturn:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from superneurons.compress import CompactTopKCodec, FFTCodec, TopKCodec, register_compression
    from superneurons.train import exit_rank

    class Dot(nn.Module):  # loss <weight, x>: the gradient is x, in one bucket
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(numel))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.weight * x).sum()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    stages = _Stages()
    if rank == 0:
        _instrument(stages)
        for cls in (CompactTopKCodec, FFTCodec, TopKCodec):
            cls.encode = stages.timed("encode", cls.encode)  # type: ignore[method-assign]
    ddp = DistributedDataParallel(Dot(), bucket_cap_mb=numel * 4 / 2**20 + 1)
    register_compression(ddp, spec)
    gen = torch.Generator().manual_seed(rank)
    steps = []
    for step in range(args.warmup + args.steps):
        x = torch.randn(numel, generator=gen)
        dist.barrier()
        if step == args.warmup:
            stages.cpu_s.clear()
            stages.wall_s.clear()
        wall0, cpu0 = time.perf_counter(), time.process_time()
        ddp(x).backward()
        steps.append((time.perf_counter() - wall0, time.process_time() - cpu0))
    dist.barrier()
    stage_cpu_s, collective_s = dict(stages.cpu_s), dict(stages.wall_s)  # before any profile
    if rank == 0:
        profile = ""
        if args.profile:
            x = torch.randn(numel, generator=gen)
            with torch.profiler.profile() as prof:
                ddp(x).backward()
            profile = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        timed = steps[args.warmup :]
        record = {
            "spec": spec,
            "numel": numel,
            "step_wall_ms": 1e3 * sum(w for w, _ in timed) / len(timed),
            "step_cpu_ms": 1e3 * sum(c for _, c in timed) / len(timed),
            "stage_cpu_ms": {k: 1e3 * v / args.steps for k, v in stage_cpu_s.items()},
            "collective_wall_ms": {k: 1e3 * v / args.steps for k, v in collective_s.items()},
            "profile": profile,
        }
        print("RECORD " + json.dumps(record), flush=True)
    else:
        if args.profile:  # rank 0 profiles one more step: take part in its collectives
            ddp(torch.randn(numel, generator=gen)).backward()
    exit_rank(0)  # barrier, destroy, os._exit while the model is alive (superneurons.train.rank)


def _port() -> int:
    for _ in range(50):
        port = random.randint(20000, 30000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def _run(argv: list[str], src: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, __file__, *argv], env=env, capture_output=True, text=True, timeout=1800
    )
    if result.returncode:
        raise RuntimeError(f"{argv} on {src} failed: {result.stderr[-2000:]}")
    return result.stdout


def _hook_pair(spec: str, numel: int, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(Path("src").resolve()), OMP_NUM_THREADS="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    argv = [sys.executable, __file__, "--hook-worker", spec, "--numel", str(numel)]
    argv += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    argv += ["--profile"] if args.profile else []
    procs = [
        subprocess.Popen([*argv, "--rank", str(rank)], env=env, stdout=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"hook {spec} at {numel}: ranks exited {[p.returncode for p in procs]}")
    line = next(x for x in outs[0].splitlines() if x.startswith("RECORD "))
    return json.loads(line[len("RECORD ") :])


def _hook_row(record: dict[str, Any], bandwidth: float) -> dict[str, Any]:
    cpu = record["stage_cpu_ms"]

    def both(name: str) -> float:  # on the hook's thread and on gloo's callback thread
        return cpu.get(name, 0.0) + cpu.get(name + " (cb)", 0.0)

    body = cpu.get("hook body", 0.0)
    encode = both("encode") + both("worker_encode")
    owner = both("owner_reduce")
    feedback = both("subtract_decode")
    decode = both("decode_mean_into") + both("decode_slices")
    inline = cpu.get("decode_mean_into", 0.0) + cpu.get("decode_slices", 0.0)
    hook = body + decode - inline
    return {
        "spec": record["spec"],
        "values": record["numel"],
        "step cpu ms": record["step_cpu_ms"],
        "step wall ms": record["step_wall_ms"],
        "hook cpu ms": hook,
        "encode": encode,
        "owner": owner,
        "error feedback": feedback,
        "decode": decode,
        "bookkeeping": body - encode - owner - feedback - inline,
        "collectives wall ms": sum(record["collective_wall_ms"].values()),
        "hook GB/s": 4 * record["numel"] / hook / 1e6 if hook else None,
        "of bandwidth": 4 * record["numel"] / hook / 1e6 / bandwidth if hook else None,
    }


def _plot(rows: list[dict[str, Any]], arms: list[str], numel: int, bandwidth: float, path: Path):
    try:
        import matplotlib
    except ImportError:  # the figures are in the Markdown and JSON already
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = [r["spec"] for r in rows if r["arm"] == arms[0] and r["values"] == numel]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    width = 0.8 / len(arms)
    for ax, what in zip(axes, ("encode", "decode"), strict=True):
        for k, arm in enumerate(arms):
            got = {r["spec"]: r.get(f"{what} GB/s") for r in rows if r["arm"] == arm}
            got = {s: v for s, v in got.items() if isinstance(v, float)}
            xs = [i + k * width for i, s in enumerate(specs) if s in got]
            ax.bar(xs, [got[s] / bandwidth for s in specs if s in got], width, label=arm)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(specs))], specs, rotation=60)
        ax.set_title(f"{what}, {numel:,} fp32 values")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    axes[0].set_ylabel(f"fraction of copy_ bandwidth ({bandwidth:.1f} GB/s)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arm", action="append", default=[], help="NAME=SRC (repeatable)")
    parser.add_argument("--specs", default=";".join(SPECS), help="';'-separated codec specs")
    parser.add_argument("--hook-specs", default=";".join(HOOK_SPECS))
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the arms")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the codecs alone")
    parser.add_argument("--no-hook", action="store_true", help="skip the 2-rank hook part")
    parser.add_argument("--no-codecs", action="store_true", help="skip the codecs-alone part")
    parser.add_argument("--profile", action="store_true", help="profile one hook step")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--codecs-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hook-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--numel", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.specs = [s for s in args.specs.split(";") if s]
    args.sizes = [int(s) for s in args.sizes.split(",")]
    if args.codecs_worker:
        codecs_worker(args)
        return 0
    if args.hook_worker is not None:
        hook_worker(args.rank, args.hook_worker, args.numel, args)
        return 0
    import bench_record
    import torch

    arms = bench_record.arms(args.arm or ["after=src"])
    torch.set_num_threads(1)
    device = args.device
    bandwidth = bandwidth_gbps(max(args.repeats, 7), device)
    print(f"copy_ of {BANDWIDTH_NUMEL:,} fp32 on {device}: {bandwidth:.2f} GB/s", flush=True)
    rows: list[dict[str, Any]] = []
    loads: dict[str, list[list[float]]] = {arm: [] for arm in arms}
    best: dict[tuple[str, str, int], dict[str, Any]] = {}
    # NOTE: arms alternate per (spec, size) and each takes its best over rounds: on a shared
    # machine a whole arm run after another met a different load (4x apart on one codec).
    for numel in [] if args.no_codecs else args.sizes:
        for spec in args.specs:
            for _ in range(args.rounds):
                for arm, src in arms.items():
                    loads[arm].append(bench_record.load_average())
                    argv = ["--codecs-worker", "--specs", spec, "--device", device]
                    argv += ["--sizes", str(numel), "--repeats", str(args.repeats)]
                    got = json.loads(_run(argv, src).splitlines()[-1])
                    kept = best.setdefault((arm, spec, numel), got)
                    for what in ("encode", "decode", "feedback"):
                        if what in got and what in kept:
                            kept[what] = max(kept[what], got[what])
    for (arm, spec, numel), got in best.items():
        row: dict[str, Any] = {"arm": arm, "spec": spec, "values": numel}
        for what in ("encode", "decode", "feedback"):
            if what in got:
                row[f"{what} GB/s"] = got[what]
                row[f"{what} of bw"] = got[what] / bandwidth
        if "error" in got:
            row["error"] = got["error"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    hooks = []
    if not args.no_hook and device == "cpu":
        for numel in args.sizes:
            for spec in [s for s in args.hook_specs.split(";") if s]:
                record = _hook_pair(spec, numel, args)
                record["load"] = bench_record.load_average()
                hooks.append(record)
                print(json.dumps(_hook_row(record, bandwidth)), flush=True)
    if args.out is None:
        return 0
    columns = ["arm", "spec", "values", "encode GB/s", "encode of bw", "decode GB/s"]
    columns += ["decode of bw", "feedback GB/s", "feedback of bw"]
    body = [
        f"**Bandwidth**: `copy_` of {BANDWIDTH_NUMEL:,} fp32 values on {device}, best of "
        f"{max(args.repeats, 7)}: **{bandwidth:.2f} GB/s** (fp32 bytes per second, the unit of "
        "every rate here; a copy also writes as many bytes).\n",
        f"**Codecs alone** (one thread, best of {args.repeats} in each of {args.rounds} rounds, "
        "the arms alternating per codec and size; `decode` = the average of two "
        "ranks' payloads into a bucket; `feedback` = what error feedback adds; two-phase "
        "rows from `strategy.measure_codecs`, whose `decode` includes the owner's stage). "
        "Load averages: in the JSON (`loads`, one per run).\n",
        bench_record.markdown_table(rows, columns),
    ]
    if hooks:
        hook_rows = [_hook_row(r, bandwidth) for r in hooks]
        body += [
            "\n**The hook, per bucket** (2 gloo ranks, loopback, one parameter = one bucket, "
            f"{args.warmup} untimed then {args.steps} timed steps; stage = CPU ms per step of "
            "the thread running it (a decode runs on gloo's callback thread, or inline in the hook "
            "when the collective had finished); `bookkeeping` = the hook body's CPU less its "
            "encode, owner stage, error feedback and inline decode; every figure "
            "the mean over the timed steps; `collectives wall ms`: issue to completion).\n",
            bench_record.markdown_table(hook_rows, list(hook_rows[0])),
        ]
        for record in hooks:
            if record.get("profile"):
                body.append(
                    f"\n**Profile**, {record['spec']} at {record['numel']:,} values (rank 0, "
                    f"one step, torch.profiler):\n\n```\n{record['profile']}```\n"
                )
    name = "codec_hook_speed" if device == "cpu" else f"codec_hook_speed-{device.split(':')[0]}"
    record_out = {"bandwidth_gbps": bandwidth, "rows": rows, "hooks": hooks, "loads": loads}
    bench_record.write(
        args.out, name, f"Codec and hook throughput against memory bandwidth ({device})",
        "\n".join(body), record_out | {"args": {k: str(v) for k, v in vars(args).items()}},
    )  # fmt: skip
    if rows:
        _plot(rows, list(arms), args.sizes[0], bandwidth, args.out / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
