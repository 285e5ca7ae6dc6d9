"""The GPU acceptance run: every CUDA path measured in one command, one summary.

    bash scripts/gpu-check.sh OUTDIR            # on a machine with a CUDA device
    bash scripts/gpu-check.sh --dry-run OUTDIR  # anywhere: the steps, their limits, targets

Runs the steps of ``STEPS`` in order, each under its own time limit and all within
``TOTAL_LIMIT_S`` (a step that would overrun is stopped and recorded as such; the next one
still runs), and writes OUTDIR/gpu-check.json and OUTDIR/gpu-check.md: versions, the device,
every step's command, status and wall time, and every figure against its target. Each step's
own artifacts (JSON, Markdown, logs) stay in OUTDIR/<step>/. Nothing is installed: the machine
must already have torch with CUDA (and pytest for the tests); the sources are this checkout's.
Without a CUDA device it refuses in one line, exit status 2.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOTAL_LIMIT_S = 540  # 9 minutes on one H100, the machine's start excluded (one call's limit is 10)
PY = sys.executable

Figures = Callable[[Path], list[dict[str, Any]]]


@dataclass(frozen=True)
class Step:
    """One command of the run: ``{out}`` in ``argv`` is this step's folder."""

    name: str
    what: str
    argv: tuple[str, ...]
    limit_s: int
    figures: Figures | None = None  # what the step measured, each against its target
    targets: tuple[str, ...] = field(default_factory=tuple)  # said in --dry-run


def figure(name: str, value: Any, target: str | None, ok: bool | None) -> dict[str, Any]:
    """``ok`` None: recorded, no target to meet."""
    return {"name": name, "value": value, "target": target, "ok": ok}


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def test_figures(out: Path) -> list[dict[str, Any]]:
    suite = ET.parse(out / "junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    skipped = [
        f"{case.get('name')}: {(case.find('skipped').get('message') or '')[:120]}"  # type: ignore[union-attr]
        for case in suite.iter("testcase")
        if case.find("skipped") is not None
    ]
    return [
        figure("cuda tests run", counts["tests"], "> 0", counts["tests"] > 0),
        figure("failed", counts["failures"], "0", counts["failures"] == 0),
        figure("errors", counts["errors"], "0", counts["errors"] == 0),
        figure("skipped", skipped, "none (each says why)", not skipped),
    ]


def demo_figures(out: Path) -> list[dict[str, Any]]:
    memory = _json(out / "memory.json")
    dense = _json(out / "dense" / "summary.json")
    ours = _json(out / "superneurons" / "summary.json")
    error = memory["planned_peak_bytes"] / memory["predicted_peak_bytes"] - 1
    return [
        figure(
            "device", ours.get("device"), "cuda", str(ours.get("device", "")).startswith("cuda")
        ),
        figure(
            "planned peak / budget",
            memory["planned_peak_bytes"] / memory["budget_bytes"],
            "<= 1",
            memory["planned_peak_bytes"] <= memory["budget_bytes"],
        ),
        figure("planned peak vs its prediction", error, "within +-3%", abs(error) <= 0.03),
        figure(
            "bytes per step, dense / ours",
            dense["bytes_per_step"] / ours["bytes_per_step"],
            "> 1",
            dense["bytes_per_step"] > ours["bytes_per_step"],
        ),
        figure(
            "test accuracy, ours - dense (points)",
            100 * (ours["final_test_accuracy"] - dense["final_test_accuracy"]),
            None,
            None,
        ),
        figure("step s, ours / dense", ours["mean_step_s"] / dense["mean_step_s"], None, None),
    ]


def weights_figures(out: Path) -> list[dict[str, Any]]:
    """benchmarks/weights_streaming_gpu.py: peaks against budgets, step times recorded."""
    rows = _json(out / "weights_streaming_gpu.json")["records"]
    figures = []
    for row in rows:
        name = row["strategy"]
        figures.append(
            figure(f"{name} peak", row["measured_peak_bytes"], "<= budget", row["within_budget"])
        )
        figures.append(figure(f"{name} step s", row["step_s"], None, None))
    return figures


def memory_figures(out: Path) -> list[dict[str, Any]]:
    body = _json(out / "memory.json")
    found: list[dict[str, Any]] = []
    for record in body["records"]:
        if record["method"] in ("checkpoint", "selective", "save_on_cpu", "compile"):
            label = record["method"]
            if record.get("compile_budget") is not None:
                label += f"(amb={record['compile_budget']})"
            measured = "skipped" not in record and record.get("peak_bytes") is not None
            found.append(
                figure(
                    f"{label}: peak / eager",
                    record.get("peak_fraction", record.get("skipped")),
                    "measured",
                    measured,
                )
            )
    for verdict in body["verdicts"]:
        at = f"ours @{verdict['budget_fraction']:.0%}"
        if "fits" not in verdict:
            found.append(figure(f"{at}", verdict.get("ours"), "a plan that fits", False))
            continue
        found.append(figure(f"{at}: fits", verdict["fits"], "True", bool(verdict["fits"])))
        found.append(
            figure(
                f"{at}: peak vs prediction",
                verdict["prediction_error"],
                "within +-3%",
                bool(verdict["prediction_ok"]),
            )
        )
        found.append(
            figure(
                f"{at}: time / fastest fitting anchor ({verdict['fastest_anchor']})",
                verdict["vs_fastest_anchor"],
                "<= 0.9",
                bool(verdict["anchor_ok"]),
            )
        )
        if "resnet50_25_ok" in verdict:
            found.append(
                figure(
                    f"{at}: time / eager",
                    verdict["step_vs_eager"],
                    "<= 1.8",
                    bool(verdict["resnet50_25_ok"]),
                )
            )
    return found


def codec_figures(out: Path) -> list[dict[str, Any]]:
    """Each codec's encode and decode rate, and what fraction of the device's memory
    bandwidth (a device ``copy_`` of 120 MB, measured in the same run) each reaches."""
    (path,) = sorted(out.glob("codec_hook_speed*.json"))  # codec_hook_speed-cuda.json on a GPU
    body = _json(path)
    bandwidth = body["bandwidth_gbps"]
    found = [figure("copy_ bandwidth GB/s", round(bandwidth, 1), "measured", bandwidth > 0)]
    for r in body["rows"]:
        name = f"{r['spec']} {r['values']:,} values: encode, decode GB/s; fraction of bandwidth"
        if "error" in r:
            found.append(figure(name, r["error"], "measured", False))
            continue
        rates = [r["encode GB/s"], r["decode GB/s"]]
        value = [round(x, 2) for x in rates] + [round(x / bandwidth, 3) for x in rates]
        found.append(figure(name, value, None, None))
    return found


def _python(arguments: str) -> tuple[str, ...]:
    """``python ARGUMENTS`` (split on spaces), with this Python."""
    return (PY, *arguments.split())


def _cli(arguments: str) -> tuple[str, ...]:
    """``python -m superneurons.cli ARGUMENTS``."""
    return _python(f"-m superneurons.cli {arguments}")


def _bench(arguments: str) -> tuple[str, ...]:
    """``bench memory --device cuda`` at the four budgets, 10 timed steps, into {out}."""
    return _cli(
        f"bench memory --device cuda --budgets 75,50,35,25 --steps 10 {arguments} --out {{out}}"
    )


MEMORY_TARGETS = (
    "every anchor measured",
    "each budget: a plan that fits, peak within +-3% of its prediction, <= 0.9x the time of the "
    "fastest anchor that fits (ResNet-50 at 25%: <= 1.8x eager)",
)

# ============================================================================================
# THE STEPS, in order. Append yours (keep the limits' sum within TOTAL_LIMIT_S): a name, one
# line of what it shows, the command ({out}: its folder), a time limit, a function that reads
# what the command wrote and returns its figures against their targets, the targets in words.
# ============================================================================================
STEPS: list[Step] = [
    Step(
        "cuda-tests",
        "every test marked cuda",
        (
            *_python("-m pytest -m cuda -q -p no:cacheprovider --junitxml {out}/junit.xml"),
            str(ROOT / "tests"),
        ),
        90,
        test_figures,
        ("0 failed, 0 errors", "skips listed with their reasons"),
    ),
    Step(
        "demo",
        "superneurons demo on one GPU (NCCL): dense DDP vs a memory plan plus FFT compression",
        _cli("demo --nproc 1 --epochs 1 --limit-steps 200 {data_args} --out {out}"),
        90,
        demo_figures,
        ("on cuda", "planned peak <= budget, within +-3% of its prediction", "fewer bytes"),
    ),
    Step(
        "memory-resnet50",
        "bench memory: ResNet-50, batch 64, 224 px, 4 budgets, every anchor",
        _bench("--model resnet50 --batch 64 --image-size 224 --anchors all --compile-budgets 0.5"),
        120,
        memory_figures,
        MEMORY_TARGETS,
    ),
    Step(
        "memory-gpt2",
        "bench memory: GPT-2 small, batch 8, T 1024, 4 budgets, every anchor",
        _bench("--model gpt2 --batch 8 --block-size 1024 --anchors all --compile-budgets 0.5"),
        90,
        memory_figures,
        MEMORY_TARGETS,
    ),
    Step(
        "codecs",
        "every codec's encode and decode GB/s on the GPU at 25 MiB and 120 MB, each as a "
        "fraction of the device's memory bandwidth (a device copy_, measured in the same run)",
        (
            *_python(
                f"{ROOT / 'benchmarks' / 'codec_hook_speed.py'} --device cuda --no-hook "
                "--sizes 6553600,30000000 --repeats 3 --out {out}"
            ),
            "--specs",
            "fft;ctopk;topk;qsgd;terngrad;signsgd;fp16;twophase:bits=1;twophase:bits=4",
        ),
        45,
        codec_figures,
        ("every codec measured; its fraction of the copy_ bandwidth recorded (no target yet)",),
    ),
    # ---- LLM plans: append the LLM measurements here --------------------------------------
    Step(
        "llm-hf-gpt2",
        "bench memory: transformers' GPT-2 (use_cache=True), batch 8, T 1024, our plans and "
        "the recompute/offload anchors",
        _bench(
            "--model hf-gpt2 --batch 8 --block-size 1024 --anchors checkpoint,selective,save_on_cpu"
        ),
        45,
        memory_figures,
        MEMORY_TARGETS,
    ),
    Step(
        "weights-streaming",
        "a 1B Llama (bf16, T 2048), every block's weights streamed from the host vs resident, "
        "the host optimizer in both, one run",
        _python("benchmarks/weights_streaming_gpu.py --out {out}"),
        60,
        weights_figures,
        ("each plan's measured peak <= its budget", "step time streamed vs resident recorded"),
    ),
]


def environment() -> dict[str, Any]:
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("transformers", "lightning", "numpy", "pytest"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    device: dict[str, Any] = {"cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        device.update(
            name=props.name,
            memory_bytes=props.total_memory,
            capability=f"{props.major}.{props.minor}",
            count=torch.cuda.device_count(),
        )
    return {
        "versions": versions,
        "device": device,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "commit": commit or None,
        "command": " ".join([PY, *sys.argv]),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _data_args(out: Path) -> list[str]:
    """The demo's Fashion-MNIST: the installed one, else a small random stand-in (its
    accuracies then mean nothing; the run still exercises every CUDA path)."""
    from superneurons.data.fashion_mnist import DEFAULT_ROOT

    if Path(DEFAULT_ROOT).is_dir():
        return []
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_data import write_fashion_mnist

    root = write_fashion_mnist(out / "random-fashion-mnist", n_train=4096, n_test=512)
    return ["--data-dir", str(root)]


def _argv(step: Step, out: Path, data_args: list[str]) -> list[str]:
    argv: list[str] = []
    for part in step.argv:
        if part == "{data_args}":
            argv += data_args
        else:
            argv.append(part.replace("{out}", str(out)))
    return argv


def run_step(step: Step, out: Path, limit_s: float, data_args: list[str]) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    argv = _argv(step, out, data_args)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
    )
    record: dict[str, Any] = {"name": step.name, "what": step.what, "command": " ".join(argv)}
    record["limit_s"] = round(limit_s)
    start = time.monotonic()
    with (out / "log.txt").open("wb") as log:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            record["exit_status"] = proc.wait(timeout=max(limit_s, 1))
            record["status"] = "ok" if record["exit_status"] == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            record["status"], record["exit_status"] = "out of time", None
    record["wall_s"] = round(time.monotonic() - start, 1)
    record["log"] = str(out / "log.txt")
    if step.figures is not None:
        try:
            record["figures"] = step.figures(out)
        except (OSError, KeyError, ValueError, TypeError, ET.ParseError, IndexError) as exc:
            record["figures"] = [figure("results", f"unreadable: {exc!r}"[:200], "written", False)]
    return record


def markdown(summary: dict[str, Any]) -> str:
    env = summary["environment"]
    dev = env["device"]
    lines = [
        "# GPU acceptance run\n",
        f"Device: {dev.get('name')} ({dev.get('memory_bytes', 0) / 2**30:.0f} GiB, capability "
        f"{dev.get('capability')}), CUDA {dev.get('cuda')}; "
        + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
        + f"; commit {env['commit']}; {env['time_utc']}.\n",
        f"Command: `{env['command']}`. Total {summary['wall_s']:.0f} s (target <= "
        f"{summary['target_wall_s']} s): **{'all targets met' if summary['ok'] else 'NOT all targets met'}**.\n",
        "| step | status | wall s | limit s | figures met |",
        "|---|---|---|---|---|",
    ]
    for step in summary["steps"]:
        figs = [f for f in step.get("figures", []) if f["ok"] is not None]
        met = f"{sum(bool(f['ok']) for f in figs)}/{len(figs)}" if figs else "-"
        lines.append(
            f"| {step['name']} | {step['status']} | {step.get('wall_s', '')} | "
            f"{step.get('limit_s', '')} | {met} |"
        )
    for step in summary["steps"]:
        lines += ["", f"## {step['name']}: {step['what']}", "", f"`{step.get('command', '')}`", ""]
        if step.get("figures"):
            lines += ["| figure | value | target | met |", "|---|---|---|---|"]
            for f in step["figures"]:
                met = "" if f["ok"] is None else ("yes" if f["ok"] else "**no**")
                value = f"{f['value']:.4g}" if isinstance(f["value"], float) else f["value"]
                lines.append(f"| {f['name']} | {value} | {f['target'] or 'no target'} | {met} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-check.sh", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output directory")
    parser.add_argument("--dry-run", action="store_true", help="list the steps; run nothing")
    args = parser.parse_args(argv)
    if args.dry_run:
        print(f"gpu-check: {len(STEPS)} steps, within {TOTAL_LIMIT_S} s, into {args.out}/")
        for index, step in enumerate(STEPS, 1):
            print(f"[{index}] {step.name} (<= {step.limit_s} s): {step.what}")
            print(f"    {' '.join(_argv(step, args.out / step.name, ['[--data-dir DIR]']))}")
            for target in step.targets:
                print(f"    target: {target}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device here (torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}); run it on a GPU machine, or pass --dry-run to list the steps",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    data_args = _data_args(args.out)
    records = []
    for step in STEPS:
        left_s = TOTAL_LIMIT_S - (time.monotonic() - started)
        if left_s < 10:
            records.append(
                {"name": step.name, "what": step.what, "status": "not run: no time left"}
            )
            continue
        print(f"gpu-check: {step.name} (<= {min(step.limit_s, left_s):.0f} s) ...", flush=True)
        records.append(run_step(step, args.out / step.name, min(step.limit_s, left_s), data_args))
        print(f"gpu-check: {step.name}: {records[-1]['status']} in {records[-1]['wall_s']} s")
    wall_s = time.monotonic() - started
    ok = wall_s <= TOTAL_LIMIT_S and all(
        r["status"] == "ok" and all(f["ok"] is not False for f in r.get("figures", []))
        for r in records
    )
    summary = {
        "environment": environment(),
        "data": "random stand-in (accuracies mean nothing)" if data_args else "Fashion-MNIST",
        "wall_s": round(wall_s, 1),
        "target_wall_s": TOTAL_LIMIT_S,
        "ok": ok,
        "steps": records,
    }
    (args.out / "gpu-check.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "gpu-check.md").write_text(markdown(summary), encoding="utf-8")
    print(
        f"gpu-check: {'all targets met' if ok else 'NOT all targets met'}; {args.out}/gpu-check.md"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
