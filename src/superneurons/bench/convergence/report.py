"""Artifacts of the convergence benchmark: JSON records, a Markdown table with the targets
checked, and the curves as a PNG (see :mod:`superneurons.bench.convergence`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from superneurons.schemes.diloco import DiLoCo

if TYPE_CHECKING:
    from superneurons.bench.convergence.config import ConvergenceConfig

__all__ = ["config_dict", "summary_lines", "time_to_loss_s", "write_artifacts"]

# Targets: a language model within 0.05 nats of dense sending >= 8x fewer bytes;
# Fashion-MNIST: the default fft within 0.5 points of dense.
LM_MAX_DELTA_NATS = 0.05
LM_MIN_RATIO = 8.0
FMNIST_MAX_LOSS_POINTS = 0.5
# DiLoCo on the language model: within 0.05 nats of dense at >= 50x fewer bytes, and (on a
# shaped link) at most half dense's time to the same loss.
DILOCO_MIN_RATIO = 50.0
DILOCO_MAX_TIME_RATIO = 0.5


def config_dict(config: ConvergenceConfig) -> dict[str, Any]:
    return asdict(config)


_COLUMNS = (
    "task",
    "model",
    "codec",
    "steps",
    "metric",
    "final_metric",
    "delta_vs_dense",
    "ratio_vs_dense",
    "wall_s",
    "median_step_s",
)


def time_to_loss_s(record: dict[str, Any], target: float) -> float | None:
    """Rank 0's training seconds (evaluations left out) until ``record``'s loss curve first
    reaches ``target``, linear between the two curve points around it; None if it never does
    (or the record has no ``curve_train_s``)."""
    times = record.get("curve_train_s") or []
    previous: tuple[float, float] | None = None
    for (_, loss), time_s in zip(record["curve"], times, strict=False):
        if loss <= target:
            if previous is None or previous[1] <= loss:
                return float(time_s)
            fraction = (previous[1] - target) / (previous[1] - loss)
            return previous[0] + fraction * (time_s - previous[0])
        previous = (time_s, loss)
    return None


def _diloco_line(record: dict[str, Any], dense: dict[str, Any] | None) -> str:
    """A DiLoCo record against dense: the gap, the bytes, and the time to the worse of the two
    final losses (the loss both reached)."""
    delta, ratio = record["delta_vs_dense"], record.get("ratio_vs_dense") or 0.0
    line = (
        f"- shakespeare: {record['codec']} {record['final_metric']:.3f} nats ({delta:+.3f} vs "
        f"dense) at {ratio:.1f}x fewer bytes; target <= +{LM_MAX_DELTA_NATS} at >= "
        f"{DILOCO_MIN_RATIO:.0f}x: "
        + ("met" if delta <= LM_MAX_DELTA_NATS and ratio >= DILOCO_MIN_RATIO else "NOT met")
    )
    if dense is None or not record.get("curve_train_s") or not dense.get("curve_train_s"):
        return line
    target = max(record["final_metric"], dense["final_metric"])
    mine, theirs = time_to_loss_s(record, target), time_to_loss_s(dense, target)
    if mine is None or theirs is None or theirs <= 0:
        return line + f"; time to {target:.3f} nats: not reached by both"
    ok = mine <= DILOCO_MAX_TIME_RATIO * theirs
    return line + (
        f"; time to {target:.3f} nats {mine:.1f} s vs dense {theirs:.1f} s "
        f"({mine / theirs:.2f}x; target <= {DILOCO_MAX_TIME_RATIO}x: {'met' if ok else 'NOT met'})"
    )


def summary_lines(records: Sequence[dict[str, Any]], config: ConvergenceConfig) -> list[str]:
    """Each target vs the measurement: fft on Fashion-MNIST within 0.5 points of dense; on the
    language model, every scheme's gap to dense and its byte ratio (target: <= 0.05 nats at
    >= 8x fewer bytes; DiLoCo's labels: >= 50x, and half dense's time to the same loss)."""
    diloco = {lb.text for lb in config.labels if isinstance(lb.sgd or lb.adam, DiLoCo)}
    lines = []
    for record in records:
        delta = record.get("delta_vs_dense")
        if delta is None or record["codec"] == "dense":
            continue
        if record["task"] == "fashion-mnist" and record["codec"] == "fft":
            verdict = "met" if delta >= -FMNIST_MAX_LOSS_POINTS else "NOT met"
            lines.append(
                f"- fashion-mnist: fft {record['final_metric']:.2f}% vs dense "
                f"{record['final_metric'] - delta:.2f}% ({delta:+.2f} points; target >= "
                f"-{FMNIST_MAX_LOSS_POINTS}: {verdict})"
            )
        if record["task"] == "shakespeare" and record["codec"] in diloco:
            dense = next(
                (r for r in records if r["task"] == "shakespeare" and r["codec"] == "dense"), None
            )
            lines.append(_diloco_line(record, dense))
        elif record["task"] == "shakespeare":
            ratio = record.get("ratio_vs_dense") or 0.0
            ok = delta <= LM_MAX_DELTA_NATS and ratio >= LM_MIN_RATIO
            decision = record.get("decision")
            chose = f" [chose {decision['scheme']}, link {decision['link']}]" if decision else ""
            lines.append(
                f"- shakespeare: {record['codec']}{chose} {record['final_metric']:.3f} nats "
                f"({delta:+.3f} vs dense) at {ratio:.1f}x fewer bytes; target <= "
                f"+{LM_MAX_DELTA_NATS} at >= {LM_MIN_RATIO:.0f}x: {'met' if ok else 'NOT met'}"
            )
    return lines


def write_artifacts(
    records: Sequence[dict[str, Any]], out_dir: Path, config: ConvergenceConfig
) -> list[Path]:
    """DIR/convergence.json, DIR/convergence.md (table + target) and DIR/convergence.png."""
    from superneurons.bench.artifacts import markdown_table, pyplot, write_json, write_markdown

    paths = [write_json(out_dir / "convergence.json", records, config=config_dict(config))]
    tasks = "; ".join(
        f"{t.task}: {t.model} {t.model_kwargs or ''}, "
        + (f"{t.steps} steps" if t.steps else f"{t.epochs} epoch(s)")
        + f", batch {t.batch_size}/rank, {t.optimizer} lr {t.lr}"
        + (f", first {t.train_limit} training samples" if t.train_limit else "")
        for t in config.tasks
    )
    rate = config.bandwidth_bit_s
    where = "on loopback" if rate is None else f"over veth links shaped to {rate / 1e6:g} Mbit/s"
    body = (
        f"{config.nproc} gloo ranks {where}, one thread each; every codec through "
        "`register_compression` with its defaults (error feedback on); `adam-momentum[...]:C` "
        "and `adam-update[...]:C` through `CompressedAdamW` (1-bit-Adam momentum after a "
        "warm-up, or local AdamW updates, averaged by codec C with error feedback); same "
        "initial weights and data order; `diloco[...]` labels train with DiLoCo (the task's "
        "optimizer inside, the outer step every H steps, evaluated on the synced model). "
        f"{tasks}. `final_metric`: test accuracy in % (Fashion-MNIST, full "
        "test set) or validation cross-entropy in nats/char (Shakespeare, lower is better); "
        "`delta_vs_dense`: final_metric minus dense's; `ratio_vs_dense`: dense fp32 bytes / "
        "bytes this rank sent, over the whole run (warm-up included).\n\n"
        + markdown_table(records, _COLUMNS)
        + "\n## Target\n\n"
        + ("\n".join(summary_lines(records, config)) or "(fft on fashion-mnist not measured)")
        + "\n"
    )
    paths.append(write_markdown(out_dir / "convergence.md", "Convergence benchmark", body))
    plt = pyplot()
    tasks_seen = list(dict.fromkeys(r["task"] for r in records))
    timed = all(r.get("curve_train_s") for r in records)  # a second row: against the clock
    rows = 2 if timed else 1
    fig, axes = plt.subplots(
        rows, len(tasks_seen), figsize=(6 * len(tasks_seen), 4.5 * rows), squeeze=False
    )
    for column, task in enumerate(tasks_seen):
        for row in range(rows):
            ax = axes[row][column]
            for record in (r for r in records if r["task"] == task):
                xs = (
                    [point[0] for point in record["curve"]] if row == 0 else record["curve_train_s"]
                )
                values = [point[1] for point in record["curve"]]
                ax.plot(xs, values, marker="o", ms=3, label=record["codec"])
            ax.set_title(task)
            ax.set_xlabel(
                "step" if row == 0 else "rank 0's training time (s, evaluations excluded)"
            )
            ax.set_ylabel(
                "test accuracy (%)" if task == "fashion-mnist" else "val loss (nats/char)"
            )
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "convergence.png", dpi=120)
    plt.close(fig)
    paths.append(out_dir / "convergence.png")
    return paths
