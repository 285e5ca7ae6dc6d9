"""The demo's report: ``report.md`` with PNG plots of the two runs and the memory comparison."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from superneurons.bench.artifacts import environment, markdown_table, pyplot

__all__ = ["headline", "read_run", "write_report"]

MiB = 2**20


def read_run(run_dir: Path) -> dict[str, Any]:
    """A run's ``summary.json`` and its step, epoch and eval records from ``metrics.jsonl``."""
    summary = json.loads((run_dir / "summary.json").read_text())
    kinds: dict[str, list[dict[str, Any]]] = {"step": [], "epoch": [], "eval": []}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        kinds.setdefault(record.get("kind", "epoch"), []).append(record)
    return {
        "summary": summary,
        "steps": kinds["step"],
        "epochs": kinds["epoch"],
        "evals": kinds["eval"],
    }


def _plot_curves(runs: Mapping[str, dict], path: Path) -> None:
    plt = pyplot()
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in runs.items():
        steps = [r["step"] for r in run["steps"]]
        ax_loss.plot(steps, [r["loss"] for r in run["steps"]], label=name)
        ax_acc.plot(
            steps, [r["accuracy"] for r in run["steps"]], label=f"{name} (train batch)", alpha=0.6
        )
        if run["epochs"] and "test_accuracy" in run["epochs"][0]:
            last_step = steps[-1] if steps else 0
            per_epoch = max(last_step // max(len(run["epochs"]), 1), 1)
            xs = [per_epoch * (i + 1) for i in range(len(run["epochs"]))]
            ax_acc.plot(
                xs,
                [r["test_accuracy"] for r in run["epochs"]],
                marker="o",
                linestyle="--",
                label=f"{name} (test)",
            )
    ax_loss.set(xlabel="step", ylabel="training loss", title="loss")
    ax_acc.set(xlabel="step", ylabel="accuracy", title="accuracy")
    for axis in (ax_loss, ax_acc):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_bytes(runs: Mapping[str, dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(runs)
    values = [runs[n]["summary"]["bytes_per_step"] / MiB for n in names]
    bars = ax.bar(names, values, color=["tab:gray", "tab:green"][: len(names)])
    ax.bar_label(bars, labels=[f"{v:.3f} MiB" for v in values])
    ax.set(ylabel="MiB sent per rank per step", title="bytes on the wire per step")
    ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_memory(memory: Mapping[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    for key, label in (
        ("eager_timeline_bytes", "eager PyTorch"),
        ("planned_timeline_bytes", f"superneurons plan ({memory['strategy']})"),
    ):
        series = memory[key]
        xs = [i / max(len(series) - 1, 1) for i in range(len(series))]
        ax.plot(xs, [b / MiB for b in series], label=label)
    ax.axhline(memory["budget_bytes"] / MiB, color="tab:red", linestyle="--", label="budget")
    ax.set(
        xlabel="fraction of one training step (forward → backward → optimizer)",
        ylabel="live device memory (MiB)",
        title="device-memory timeline of one step",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_race(runs: Mapping[str, dict], race: Mapping[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, run in runs.items():
        evals = run["evals"]
        ax.plot(
            [r["train_s"] for r in evals],
            [100 * r["test_accuracy"] for r in evals],
            marker="o",
            label=name,
        )
    target = 100 * race["dense_final_accuracy"]
    ax.axhline(target, color="tab:gray", linestyle=":", label="dense's final accuracy")
    ax.set(
        xlabel="training wall-clock time (s, evaluations not counted)",
        ylabel="test accuracy (%)",
        title="test accuracy against wall-clock time, same link, same budget",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_lm(trl: Mapping[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for key, label in (
        ("trl_checkpointing", "TRL with its gradient checkpointing"),
        ("superneurons", "TRL with SuperNeuronsCallback"),
    ):
        series = trl[key]["timeline_bytes"]
        xs = [i / max(len(series) - 1, 1) for i in range(len(series))]
        ax.plot(xs, [b / MiB for b in series], label=label)
    if "budget_bytes" in trl["superneurons"]:
        budget = trl["superneurons"]["budget_bytes"] / MiB
        ax.axhline(budget, color="tab:red", linestyle="--", label="budget")
    ax.set(
        xlabel="fraction of one SFTTrainer step",
        ylabel="live memory (MiB)",
        title="a tiny Llama's last training step, measured",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_VIEWS = {
    "c10 cpu allocator": "the c10 CPU allocator's bytes (tensors and the scratch kernels "
    "allocate for themselves, as the plan predicts them)",
    "live storages": "dispatch-level live-storage accounting (device-resident tensors)",
}


def headline(demo: Mapping[str, Any]) -> list[str]:
    """The report's first screen: its title line and three lines (faster over a slow link,
    less memory, accuracy held), every figure read from the demo's JSON."""
    link, race, memory = demo["link"], demo["race"], demo["memory"]
    setting = f"{demo['ranks']} ranks, `{demo['model']}` on `{demo['data']}`"
    if link["shaped"]:
        title = f"# superneurons demo: over a {link['description']}"
        where = f"over {_rate(link['rate_bit_s'])} ({setting})"
    else:
        title = (
            f"# superneurons demo: ON LOOPBACK, no slow link ({link['loopback_reason']}); "
            "the race shows codec cost, not a slow network"
        )
        where = f"on loopback ({setting})"
    ratio = race["time_to_dense_accuracy_ratio"]
    if ratio is None:
        faster = (
            f"- **Over a slow link:** {where}, superneurons did not reach dense DDP's final test "
            f"accuracy ({100 * race['dense_final_accuracy']:.2f}%) within its "
            f"{race['superneurons_train_s']:.0f} s."
        )
    else:
        faster = (
            f"- **Over a slow link:** {where}, superneurons reached dense DDP's final test "
            f"accuracy ({100 * race['dense_final_accuracy']:.2f}%) in **{ratio:.2f}x** dense's "
            f"wall-clock time ({race['superneurons_time_to_accuracy_s']:.0f} s vs "
            f"{race['dense_time_to_accuracy_s']:.0f} s of training)."
        )
    faster += _best_phrase(race)
    less = (
        f"- **Less memory:** one training step of that model peaks at "
        f"{memory['planned_peak_bytes'] / MiB:.1f} MiB under the plan vs "
        f"{memory['eager_peak_bytes'] / MiB:.1f} MiB eager "
        f"(**{memory['planned_peak_bytes'] / memory['eager_peak_bytes']:.2f}x**, measured)"
    )
    trl = (demo.get("lm") or {}).get("trl")
    if trl is not None:
        less += (
            f"; a tiny Llama under TRL's SFTTrainer peaks at "
            f"{trl['superneurons']['peak_bytes'] / MiB:.1f} MiB with the callback vs "
            f"{trl['trl_checkpointing']['peak_bytes'] / MiB:.1f} MiB with TRL's own "
            f"checkpointing (**{trl['peak_over_trl']:.2f}x**), losses {losses_phrase(trl)}"
        )
    held = (
        f"- **Accuracy held:** after the same {race['dense_train_s']:.0f} s budget, test "
        f"accuracy {100 * race['superneurons_final_accuracy']:.2f}% (superneurons, "
        f"{race['superneurons_steps']} steps) vs {100 * race['dense_final_accuracy']:.2f}% "
        f"(dense, {race['dense_steps']} steps): **{race['accuracy_delta_points']:+.2f} points** "
        f"on the first {demo['eval_limit']} test images."
    )
    return [title, "", faster, less + ".", held]


def _best_phrase(race: Mapping[str, Any]) -> str:
    """Where dense's curve rose above its final accuracy: how long each arm took to its best
    (a noisy curve can touch its final accuracy early and fall back). Empty otherwise."""
    best = race.get("dense_best_accuracy")
    if best is None or best <= race["dense_final_accuracy"]:
        return ""
    ratio = race["time_to_dense_best_accuracy_ratio"]
    dense_s = race["dense_time_to_best_s"]
    if ratio is None:
        return (
            f" Dense's best along the way, {100 * best:.2f}% at {dense_s:.0f} s, superneurons "
            "did not reach."
        )
    return (
        f" Dense's best along the way, {100 * best:.2f}%, superneurons reached in "
        f"**{ratio:.2f}x** dense's time ({race['superneurons_time_to_dense_best_s']:.0f} s vs "
        f"{dense_s:.0f} s)."
    )


def _rate(rate_bit_s: int) -> str:
    from superneurons.rates import format_rate

    return format_rate(rate_bit_s)


def _race_section(demo: Mapping[str, Any], data: Mapping[str, dict]) -> list[str]:
    race, link = demo["race"], demo["link"]
    rows = []
    for name, run in data.items():
        summary = run["summary"]
        key = "dense" if name == "dense DDP" else "superneurons"
        rows.append(
            {
                "arm": name,
                "codec": summary["codec"],
                "steps": race[f"{key}_steps"],
                "training (s)": race[f"{key}_train_s"],
                "step (s)": summary["mean_step_s"],
                "MiB sent per step": summary["bytes_per_step"] / MiB,
                "final test accuracy (%)": 100 * race[f"{key}_final_accuracy"],
                "time to dense's final accuracy (s)": race[f"{key}_time_to_accuracy_s"],
            }
        )
    why = link["why"] if link["shaped"] else f"No link was shaped: {link['loopback_reason']}."
    return [
        "## The race: the same link, the same wall-clock budget\n",
        f"Link: {link['description']}. {why}\n",
        markdown_table(rows, list(rows[0])),
        f"\n`time_to_dense_accuracy_ratio` = {_fmt(race['time_to_dense_accuracy_ratio'])} "
        "(superneurons' time to dense's final test accuracy over dense's; the time of the "
        "first evaluation at or above it, so an upper bound)"
        + _best_ratio_phrase(race)
        + ". Load average after each arm: "
        + ", ".join(f"{k} {v:.1f}" for k, v in race["load_avg_1m_after"].items())
        + ".\n",
        "![accuracy against wall-clock time](race.png)\n",
    ]


def _best_ratio_phrase(race: Mapping[str, Any]) -> str:
    if "time_to_dense_best_accuracy_ratio" not in race:  # a demo.json from before the key
        return ""
    return (
        f"; `time_to_dense_best_accuracy_ratio` = "
        f"{_fmt(race['time_to_dense_best_accuracy_ratio'])} (the same for dense's best test "
        f"accuracy along its curve, {100 * race['dense_best_accuracy']:.2f}%)"
    )


def _fmt(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.3f}"


def _lm_section(lm: Mapping[str, Any]) -> list[str]:
    cards = lm["cards_gib"]
    rows = []
    for row in lm["what_fits"]:
        record = {"model": row["model"], "tuning": row["tuning"], "tokens": row["seq_len"]}
        for key, label in (
            ("hf_checkpointing", "HF checkpointing"),
            ("superneurons", "superneurons"),
        ):
            fits = "/".join("yes" if row[f"{key}_fits_{c}gib"] else "no" for c in cards)
            record[f"{label} GiB (fits {'/'.join(f'{c}' for c in cards)} GiB)"] = (
                f"{row[f'{key}_bytes'] / 2**30:.2f} ({fits})"
            )
        record["superneurons' strategy"] = row["superneurons_strategy"]
        rows.append(record)
    trl = lm["trl"]
    ours, base = trl["superneurons"], trl["trl_checkpointing"]
    return [
        "## The language-model part\n",
        "What fits: `superneurons plan --model hf:NAME --seq-len T --dtype bf16 [--lora "
        "r=16,alpha=32,targets=all-linear [--quantize nf4,double_quant=true]]` (fake tensors, "
        "AdamW, batch 1), modelled peaks: HF gradient checkpointing (every block recomputed) and "
        "superneurons' floor, each extrapolated in depth from 4- and 8-layer copies as `plan "
        "--fit-depth` does.\n",
        markdown_table(rows, list(rows[0])),
        f"\nTRL's `SFTTrainer`, {trl['model']}, {trl['steps']} steps, measured each step's peak "
        f"of live storage bytes: TRL's own gradient checkpointing "
        f"{base['peak_bytes'] / MiB:.2f} MiB; with `SuperNeuronsCallback(budget_fraction="
        f"{trl['budget_fraction']})` {ours['peak_bytes'] / MiB:.2f} MiB (budget "
        f"{ours.get('budget_bytes', 0) / MiB:.2f} MiB, within it: {trl['within_budget']}; "
        f"{trl['peak_over_trl']:.2f}x TRL's peak). Losses with TRL's checkpointing "
        f"{base['losses']}, with the callback {ours['losses']}: {losses_phrase(trl)}.\n",
        "![memory timelines](lm.png)\n",
    ]


def losses_phrase(trl: dict[str, Any]) -> str:
    """How the callback's losses compare with TRL's alone, in words."""
    if trl["losses_identical"]:
        return "identical"
    first = "the first identical, " if trl.get("first_loss_identical") else ""
    return (
        f"{first}the largest relative difference {trl['loss_max_rel_diff']:.1e} (the chunked "
        "head sums its weight's gradient chunk by chunk, in another order than one GEMM)"
    )


def write_report(
    out_dir: Path,
    *,
    demo: Mapping[str, Any],
    runs: Mapping[str, Path],
    memory: Mapping[str, Any],
) -> Path:
    """Write ``out_dir/report.md`` and its plots from the demo's record (``demo.json``) and the
    arms' runs; return the report's path."""
    data = {name: read_run(path) for name, path in runs.items()}
    _plot_race(data, demo["race"], out_dir / "race.png")
    _plot_curves(data, out_dir / "curves.png")
    _plot_bytes(data, out_dir / "bytes.png")
    _plot_memory(memory, out_dir / "memory.png")
    lm = demo.get("lm")
    if lm is not None:
        _plot_lm(lm["trl"], out_dir / "lm.png")
    env = environment()
    dense, ours = (data[n]["summary"] for n in runs)
    body = [
        *headline(demo),
        "",
        *_race_section(demo, data),
        "## Device memory of one step\n",
        f"Compression sent **{dense['bytes_per_step'] / ours['bytes_per_step']:.1f}x fewer "
        f"bytes** per step; the memory plan (`{memory['strategy']}`: "
        f"{memory['actions']['recompute']} recompute, {memory['actions']['offload']} offload, "
        f"{memory['actions']['keep']} keep units) cut the measured peak from "
        f"{memory['eager_peak_bytes'] / MiB:.1f} MiB to {memory['planned_peak_bytes'] / MiB:.1f} "
        f"MiB (budget {memory['budget_bytes'] / MiB:.1f} MiB, predicted "
        f"{memory['predicted_peak_bytes'] / MiB:.1f} MiB, host pool "
        f"{memory['host_bytes'] / MiB:.1f} MiB), measured as {_VIEWS[memory['measured_by']]}; "
        "the host pool excluded.\n",
        "![memory](memory.png)\n",
        *(_lm_section(lm) if lm is not None else []),
        "## Loss per step, and bytes on the wire\n",
        "![curves](curves.png)\n\n![bytes](bytes.png)\n",
        "## How this was made\n",
        f"`superneurons demo{' --quick' if demo['quick'] else ''}`: {demo['device']}. Machine: "
        f"{env['machine']['cpu']} ({env['machine']['cpu_count']} cores), torch "
        f"{env['versions']['torch']}. Total demo time {demo['wall_s']:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in demo.get("parts_s", {}).items())
        + f"); load average at "
        f"the end {', '.join(f'{x:.1f}' for x in demo['load_avg'])}. Every figure above is "
        "read from `demo.json`.\n",
    ]
    path = out_dir / "report.md"
    path.write_text("\n".join(body), encoding="utf-8")
    return path
