"""Artifacts of the network benchmark: JSON records, a Markdown table with the targets checked
and the step-time breakdown, and a PNG of step time per codec and link (see
:mod:`superneurons.bench.network.run`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from superneurons.bench.artifacts import markdown_table, pyplot, write_json, write_markdown
from superneurons.bench.network.extrapolate import write_extrapolation
from superneurons.bench.network.run import NetworkBenchConfig, config_dict
from superneurons.bench.network.scale import scale_lines

__all__ = ["summary_lines", "write_artifacts"]


def summary_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    """The targets (FFT >= 4x dense and >= torch-powersgd at 100 Mbit/s, >= 1.5x at 1 Gbit/s,
    on the FC-heavy model) checked against the measurements."""
    by_key = {
        (r["bandwidth"], r["model"], r["codec"]): r for r in records if r.get("nproc", 2) == 2
    }
    lines = []
    for bandwidth, target in (("100mbit", 4.0), ("1gbit", 1.5)):
        fft = by_key.get((bandwidth, "fc-heavy", "fft"))
        if fft is None or fft.get("speedup_vs_dense") is None:
            continue
        speedup = float(fft["speedup_vs_dense"])
        verdict = "met" if speedup >= target else "NOT met"
        line = f"- {bandwidth}, fc-heavy: fft {speedup:.2f}x dense (target >= {target}x: {verdict})"
        if fft.get("idle_speedup_est"):
            line += f" [idle-core estimate {float(fft['idle_speedup_est']):.2f}x]"
        anchor = by_key.get((bandwidth, "fc-heavy", "torch-powersgd:rank=4"))
        if bandwidth == "100mbit" and anchor and anchor.get("mean_step_s"):
            ratio = float(anchor["mean_step_s"]) / float(fft["mean_step_s"])
            ok = "met" if ratio >= 1.0 else "NOT met"
            line += f"; {ratio:.2f}x torch-powersgd (target >= 1x: {ok})"
            if anchor.get("idle_step_s_est") and fft.get("idle_step_s_est"):
                est = float(anchor["idle_step_s_est"]) / float(fft["idle_step_s_est"])
                line += f" [idle-core estimate {est:.2f}x]"
        lines.append(line)
    return lines


_COLUMNS = (
    "bandwidth", "nproc", "model", "codec", "data", "mean_step_s", "predicted_train_step_s",
    "speedup_vs_dense", "compute_step_s", "comm_s", "wire_s_est", "other_s", "cpu_step_s",
    "idle_step_s_est", "idle_speedup_est", "bytes_per_step", "bytes_source",
    "bytes_received_per_rank", "status",
)  # fmt: skip


def write_artifacts(
    records: Sequence[dict[str, Any]], out_dir: Path, config: NetworkBenchConfig, *, note: str = ""
) -> list[Path]:
    """DIR/network.json, DIR/network.md (table + targets) and DIR/network.png."""
    extra: dict[str, Any] = {"note": note} if note else {}
    scale = scale_lines(records, config.compressions)
    paths = [write_json(out_dir / "network.json", records, config=config_dict(config), **extra)]
    link_lines = sorted(
        {
            f"- {r['bandwidth']}: measured {r['measured_link_bit_s'] / 1e6:.0f} Mbit/s TCP goodput"
            for r in records
            if r.get("measured_link_bit_s")
        }
    )
    body = (
        (f"**{note}**\n\n" if note else "")
        + f"{', '.join(map(str, config.nprocs))} ranks, one thread each, gloo over veth links "
        "shaped with tbf (more than 2 ranks: one veth per rank into a bridge, both ends "
        "shaped); "
        f"batch {config.batch_size} per rank; {config.warmup_steps} warm-up steps excluded "
        "(`auto`: every step up to its decision; each record's `warmup_steps`), "
        + _timed(config)
        + " `bytes_per_step`: bytes one rank sends per step "
        "(see `bytes_source`: the hook's counter of payload bytes, or for dense DDP the "
        "analytic ring all-reduce volume 2(P-1)/P x 4 bytes x parameters; with 2 ranks both "
        "equal what one rank sends). torch-powersgd runs in one DDP bucket "
        "(`ddp_bucket_cap_mb`): torch's hook crashes on gloo with several. "
        "`compute_step_s`: the same step without communication. `data`: what the ranks "
        "trained on (real: Fashion-MNIST; random: noise batches). `predicted_train_step_s`: "
        "the default `auto` record's cost-model prediction for this route, a whole step. "
        "`wire_s_est`: bytes_per_step at the measured TCP goodput; `other_s`: the rest "
        "(encode/decode, synchronisation; negative when communication overlaps backward). "
        "`cpu_step_s`: rank 0's CPU seconds per step (all threads; no waiting), which other "
        "processes on a shared machine do not inflate; `idle_step_s_est` = cpu_step_s + "
        "wire_s_est, an estimate of the step with a core per rank (no overlap assumed), and "
        "`idle_speedup_est` its ratio to dense's: estimates, not measurements. "
        f"{_load_note(records)}\n\n"
        + ("\n".join(link_lines) + "\n\n" if link_lines else "")
        + markdown_table(records, _COLUMNS)
        + "\n## Targets\n\n"
        + ("\n".join(summary_lines(records)) or "(fc-heavy at 100mbit/1gbit not measured)")
        + "\n"
        + ("\n## Across world sizes\n\n" + "\n".join(scale) + "\n" if scale else "")
    )
    paths.append(write_markdown(out_dir / "network.md", "Network benchmark", body))
    paths.append(_plot(records, out_dir / "network.png", pyplot()))
    paths += write_extrapolation(
        records, out_dir, config.compressions, predict_nprocs=config.predict_nprocs
    )
    return paths


def _load_note(records: Sequence[dict[str, Any]]) -> str:
    loads = [r["load_avg_1m"] for r in records if r.get("load_avg_1m") is not None]
    if not loads:
        return ""
    cores = os.cpu_count() or 1
    verdict = (
        "above the core count: other processes shared the CPU, and compute-bound parts "
        "(compute, encode/decode) are inflated"
        if max(loads) > cores
        else "at or below the core count"
    )
    return (
        f"1-minute load average while measuring: {min(loads):.1f} to {max(loads):.1f} on "
        f"{cores} cores ({verdict})."
    )


def _plot(records: Sequence[dict[str, Any]], path: Path, plt: Any) -> Path:
    models = list(dict.fromkeys(r["model"] for r in records))
    several = len({r.get("nproc", 2) for r in records}) > 1

    def series(record: dict[str, Any]) -> str:
        return (
            f"{record['bandwidth']}, P={record.get('nproc', 2)}" if several else record["bandwidth"]
        )

    bandwidths = list(dict.fromkeys(series(r) for r in records))
    codecs = list(dict.fromkeys(r["codec"] for r in records))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    width = 0.8 / max(len(bandwidths), 1)
    for ax, model in zip(axes[0], models, strict=True):
        for b, bandwidth in enumerate(bandwidths):
            rows = {
                r["codec"]: r for r in records if r["model"] == model and series(r) == bandwidth
            }
            heights = [rows.get(c, {}).get("mean_step_s") or 0.0 for c in codecs]
            xs = [i + (b - (len(bandwidths) - 1) / 2) * width for i in range(len(codecs))]
            ax.bar(xs, heights, width=width, label=bandwidth)
        compute = [
            r["compute_step_s"] for r in records if r["model"] == model and r.get("compute_step_s")
        ]
        if compute:
            ax.axhline(
                sum(compute) / len(compute), color="black", ls="--", lw=1, label="compute only"
            )
        ax.set_xticks(range(len(codecs)))
        ax.set_xticklabels(codecs, rotation=45, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("mean step time (s)")
        ax.set_title(model)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _timed(config: NetworkBenchConfig) -> str:
    """What each record's step time is the mean of."""
    if config.rounds == 1:
        return f"mean of {config.steps} timed steps."
    return (
        f"mean of {config.rounds} x {config.steps} timed steps: {config.rounds} rounds, each a "
        "fresh launch of the ranks with its own warm-up, the codecs forwards in the first, "
        "backwards in the second and so on (drift of the machine falls on every codec alike; "
        "each round's numbers under the record's `rounds`)."
    )
