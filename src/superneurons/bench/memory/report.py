"""The memory benchmark's report: a table row per record, the verdicts per budget, a plot.

Verdicts, per budget B (a fraction of eager's measured peak):

* ``fits``: our measured peak <= B;
* ``prediction_error``: measured / predicted - 1 (target within +-3%);
* ``vs_fastest_anchor``: our step time / that of the fastest anchor whose measured peak also
  fits B (target <= 0.9x; where no anchor fits, ours must);
* ResNet-50 at 25%: our step <= 1.8x eager's.

Step times are CUDA-event times on CUDA; on CPU the verdicts compare process CPU time, which
another process's load inflates far less than wall time (measured here: 4.3x wall vs CPU time
at load average 15 on 2 cores).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["COLUMNS", "plot", "report_markdown", "table_rows", "verdicts"]

COLUMNS = (
    "model",
    "method",
    "budget_fraction",
    "peak_mib",
    "predicted_mib",
    "peak_fraction",
    "step_ms",
    "step_cpu_ms",
    "step_ratio_vs_eager",
    "cpu_ratio_vs_eager",
    "plan",
    "note",
)
ANCHOR_METHODS = ("checkpoint", "selective", "save_on_cpu", "compile")
TARGET_VS_ANCHOR = 0.9
TARGET_PREDICTION = 0.03
TARGET_RESNET50_25 = 1.8
_MIB = 1024.0**2


def table_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One display row per record (MiB, ms, a compact plan, a note)."""
    eager_cpu_s = next((r.get("step_cpu_s") for r in records if r["method"] == "eager"), None)
    rows = []
    for record in records:
        row = dict(record)
        if record.get("step_cpu_s") is not None and eager_cpu_s:
            row["cpu_ratio_vs_eager"] = record["step_cpu_s"] / eager_cpu_s
        if record.get("peak_bytes") is not None:
            row["peak_mib"] = record["peak_bytes"] / _MIB
        if record.get("predicted_peak_bytes"):
            row["predicted_mib"] = record["predicted_peak_bytes"] / _MIB
        if record.get("step_s") is not None:
            row["step_ms"] = record["step_s"] * 1e3
        if record.get("step_cpu_s") is not None:
            row["step_cpu_ms"] = record["step_cpu_s"] * 1e3
        if "actions" in record:
            row["plan"] = "/".join(f"{a[0]}{n}" for a, n in record["actions"].items() if n) + (
                "+opt" if record.get("optimizer_in_backward") else ""
            )
        if record.get("compile_budget") is not None:
            row["budget_fraction"] = f"amb={record['compile_budget']}"
        row["note"] = record.get("skipped") or record.get("peak_note") or ""
        rows.append(row)
    return rows


def _time_key(records: list[dict[str, Any]]) -> str:
    eager = next(r for r in records if r["method"] == "eager")
    return "step_cpu_s" if eager.get("step_cpu_s") is not None else "step_s"


def verdicts(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One verdict per budget of ``ours`` (see the module doc)."""
    key = _time_key(records)
    eager = next(r for r in records if r["method"] == "eager")
    anchors = [
        r
        for r in records
        if r["method"] in ANCHOR_METHODS
        and r.get("peak_bytes") is not None
        and r.get(key) is not None
    ]
    out = []
    for ours in (r for r in records if r["method"] == "ours"):
        fraction = ours["budget_fraction"]
        budget = fraction * eager["peak_bytes"]
        verdict: dict[str, Any] = {
            "model": ours["model"],
            "budget_fraction": fraction,
            "time": key,
        }
        if ours.get("peak_bytes") is None:
            verdict["ours"] = ours.get("skipped", "not measured")
            out.append(verdict)
            continue
        fitting = [a for a in anchors if a["peak_bytes"] <= budget]
        fastest = min(fitting, key=lambda a: a[key]) if fitting else None
        error = ours["peak_bytes"] / ours["predicted_peak_bytes"] - 1
        verdict.update(
            fits=ours["peak_bytes"] <= budget,
            prediction_error=error,
            prediction_ok=abs(error) <= TARGET_PREDICTION,
            step_vs_eager=ours[key] / eager[key],
            fastest_anchor=_anchor_name(fastest) if fastest else None,
            vs_fastest_anchor=ours[key] / fastest[key] if fastest else None,
        )
        verdict["anchor_ok"] = (
            verdict["vs_fastest_anchor"] <= TARGET_VS_ANCHOR if fastest else verdict["fits"]
        )
        if ours["model"] == "resnet50" and abs(fraction - 0.25) < 1e-9:
            verdict["resnet50_25_ok"] = verdict["step_vs_eager"] <= TARGET_RESNET50_25
        out.append(verdict)
    return out


def _anchor_name(record: dict[str, Any]) -> str:
    if record.get("compile_budget") is not None:
        return f"compile(amb={record['compile_budget']})"
    return str(record["method"])


def verdict_table(rows: list[dict[str, Any]]) -> str:
    from superneurons.bench.artifacts import markdown_table

    columns = (
        *("budget_fraction", "fits", "prediction_error", "step_vs_eager", "fastest_anchor"),
        *("vs_fastest_anchor", "anchor_ok", "resnet50_25_ok", "ours"),
    )
    return markdown_table(rows, columns, floatfmt=".3f")


def report_markdown(records: list[dict[str, Any]], *, device: str, load: str) -> str:
    """The Markdown body: the table, the verdicts and how the figures were measured."""
    from superneurons.bench.artifacts import markdown_table

    eager = next(r for r in records if r["method"] == "eager")
    how = (
        "Peaks are `torch.cuda.max_memory_allocated` over one steady-state step (peak stats "
        "reset after a warm-up step); times are medians of steps timed by CUDA events."
        if device == "cuda"
        else "Peaks are the c10 CPU allocator's over one steady-state step (torch.profiler "
        "memory events: kernel scratch and what torch.compile's generated code allocates "
        "included; the dispatch-level live-storage count, host memory excluded, is "
        "`tracked_peak_bytes` in the JSON); times are medians of CPU steps with one thread "
        "(process CPU time in the JSON as `step_cpu_s`)."
    )
    return "\n".join(
        [
            markdown_table(table_rows(records), COLUMNS),
            f"Eager: peak {eager['peak_bytes'] / _MIB:.1f} MiB, {eager['step_s'] * 1e3:.2f} ms "
            f"per step; bytes beyond live tensors (workspaces): {eager['workspace_bytes']}. " + how,
            "",
            "## Verdicts (targets: fits; prediction within +-3%; <= 0.9x the fastest anchor "
            "that fits; ResNet-50 at 25%: <= 1.8x eager)",
            "",
            verdict_table(verdicts(records)),
            f"Load average (1/5/15 min) at the end: {load}; step times on a shared machine are "
            "noisy: compare ratios measured in the same run.",
            "",
        ]
    )


def plot(records: list[dict[str, Any]], path: Path, *, device: str) -> None:
    """Peak vs step time (CPU: process CPU time), both relative to eager, one series per method."""
    from superneurons.bench.artifacts import pyplot

    key = _time_key(records)
    eager = next(r for r in records if r["method"] == "eager")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for method in sorted({r["method"] for r in records}):
        points = [
            (r["peak_fraction"], r[key] / eager[key])
            for r in records
            if r["method"] == method
            and r.get("peak_fraction") is not None
            and r.get(key) is not None
        ]
        if points:
            xs, ys = zip(*sorted(points), strict=True)
            ax.plot(xs, ys, marker="o", linestyle="-" if len(xs) > 1 else "", label=method)
    for fraction in sorted({r["budget_fraction"] for r in records if r["method"] == "ours"}):
        ax.axvline(fraction, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("device peak / eager peak (dotted: budgets)")
    ax.set_ylabel(f"{'CPU time' if key == 'step_cpu_s' else 'step time'} / eager's")
    ax.set_title(f"{records[0]['model']}: peak vs step time ({device})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
