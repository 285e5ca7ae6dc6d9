"""The network benchmark carried to world sizes and link rates it could not run.

``auto`` records the inputs of its decision in each run (``sync_inputs``: bucket timeline,
backward, per-candidate costs, the α-β lines fitted on that run's ranks). From them the cost
model (:mod:`superneurons.strategy.cost`) predicts every candidate's whole training step:

* at each measured world size, from that run's own inputs, side by side with the step
  measured for the same codec (how far to trust the model);
* at ``predict_nprocs`` (64 and 512), from the smallest run's compute and codec costs (its
  ranks had the most CPU each; on this machine 8 ranks share 2 cores, a cluster gives each
  its own) and the largest run's network fit, carried by the ring factors
  (:meth:`~superneurons.strategy.NetworkModel.at_world_size`);
* at 10 and 100 Gbit/s by scaling every fitted per-byte time by the ratio of rates
  (:func:`~superneurons.strategy.decide_at`): a model, no measurement; gloo's CPU work inside
  a collective does not get faster with the link, so these are optimistic for the wire.

:func:`extrapolation` returns the rows; :func:`write_extrapolation` writes JSON, Markdown and a
PNG beside the benchmark's own artifacts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from superneurons.bench.artifacts import pyplot, write_json, write_markdown
from superneurons.codecs.cast import Bf16Codec
from superneurons.codecs.powersgd import PowerSGD
from superneurons.codecs.sparse.compacttopk import CompactTopKCodec
from superneurons.codecs.twophase import TwoPhase
from superneurons.schemes.anchors import TorchDense
from superneurons.schemes.auto import Auto
from superneurons.schemes.compose import unwrap
from superneurons.schemes.grammar import Compression

__all__ = ["TABLE_CODECS", "extrapolation", "write_extrapolation"]

# The table's rows: label -> what it names (tests/test_bench_network.py checks each parses so).
TABLE_CODECS: dict[str, Compression] = {
    "dense": TorchDense(),
    "bf16": Bf16Codec(),
    "powersgd:rank=4": PowerSGD(rank=4),
    "twophase:bits=1": TwoPhase(bits=1),
    "twophase:bits=4": TwoPhase(bits=4),
    "ctopk": CompactTopKCodec(),
}
TABLE_RATES_BIT_S: tuple[float, ...] = (1e9, 1e10, 1e11)
_MEASURED_RATE = "1gbit"


def candidate(compression: Compression) -> str:
    """What ``auto``'s candidates call ``compression`` (wrappers dropped): ``"dense"`` or the
    base's canonical spec."""
    return str(unwrap(compression).base.spec)


def _rate_name(rate_bit_s: float) -> str:
    return f"{rate_bit_s / 1e9:g} Gbit/s"


def extrapolation(
    records: Sequence[dict[str, Any]],
    compressions: Mapping[str, Compression],
    *,
    predict_nprocs: Sequence[int] = (64, 512),
) -> tuple[list[dict[str, Any]], list[str]]:
    """``(rows, choices)``: a row per (model, codec, rate, world size) with the measured and
    the predicted whole step, and a line per predicted setting saying what ``auto`` would
    choose there. ``compressions``: what each record's codec label names (labels it lacks are
    left out). Empty without ``auto`` records that carry their inputs at 1 Gbit/s."""
    from superneurons.strategy import DecisionInputs, decide_at, predicted_steps

    named = {label: candidate(c) for label, c in compressions.items()}
    autos = {label for label, c in compressions.items() if isinstance(unwrap(c).base, Auto)}
    rows: list[dict[str, Any]] = []
    choices: list[str] = []
    ok = [r for r in records if r.get("status") == "ok" and r.get("bandwidth") == _MEASURED_RATE]
    for model in dict.fromkeys(r["model"] for r in ok):
        mine = [r for r in ok if r["model"] == model]
        inputs = {
            int(r.get("nproc", 2)): DecisionInputs.from_dict(
                {**r["sync_inputs"], "link_bit_s": r.get("bandwidth_bit_s")}
            )
            for r in mine
            if r["codec"] in autos and r.get("sync_inputs")
        }
        if not inputs:
            continue
        measured = {
            (int(r.get("nproc", 2)), named[r["codec"]]): float(r["mean_step_s"])
            for r in mine
            if r["codec"] in named
        }
        specs = [candidate(c) for c in TABLE_CODECS.values()]
        base, wide = inputs[min(inputs)], inputs[max(inputs)]
        for rate in TABLE_RATES_BIT_S:
            scaled = None if rate == wide.link_bit_s else rate
            for p in sorted({*inputs, *predict_nprocs}):
                if p in inputs:
                    where: dict[str, Any] = {
                        "link_bit_s": None if rate == inputs[p].link_bit_s else rate
                    }
                    steps = predicted_steps(inputs[p], specs, **where)
                    basis = f"P={p} run"
                else:
                    where = {"world_size": p, "network": wide.network,
                             "network_link_bit_s": wide.link_bit_s, "link_bit_s": scaled}  # fmt: skip
                    steps = predicted_steps(base, specs, **where)
                    basis = f"P={min(inputs)} compute, P={max(inputs)} network"
                    assignment = decide_at(base, **where)
                    choices.append(f"- {model}, P={p}, {_rate_name(rate)}: {assignment.reason}")
                for label, spec in [*zip(TABLE_CODECS, specs, strict=True), ("auto", "auto")]:
                    at_rate = rate == inputs.get(p, base).link_bit_s
                    rows.append(
                        {
                            "model": model,
                            "codec": label,
                            "rate_bit_s": rate,
                            "nproc": p,
                            "measured_step_s": measured.get((p, spec)) if at_rate else None,
                            "predicted_step_s": steps.get(spec),
                            "basis": basis,
                        }
                    )
    return rows, choices


def _markdown(rows: Sequence[dict[str, Any]], choices: Sequence[str]) -> str:
    nprocs = sorted({int(r["nproc"]) for r in rows})
    header = "| model | codec | link | " + " | ".join(f"P={p}" for p in nprocs) + " |\n"
    header += "|---|---|---|" + "---|" * len(nprocs) + "\n"
    cells: dict[tuple[str, str, float], dict[int, str]] = {}
    for r in rows:
        meas, pred = r["measured_step_s"], r["predicted_step_s"]
        text = "" if pred is None else f"{pred:.3g}"
        if meas is not None:
            text = f"**{meas:.3g}** / {text}"
        cells.setdefault((r["model"], r["codec"], r["rate_bit_s"]), {})[int(r["nproc"])] = text
    lines = [
        f"| {model} | {codec} | {_rate_name(rate)} | "
        + " | ".join(by_p.get(p, "") for p in nprocs)
        + " |"
        for (model, codec, rate), by_p in cells.items()
    ]
    return (
        "Seconds per training step. **Bold**: measured (the benchmark's "
        "mean step), then the cost model's prediction from that run's own recorded inputs; "
        "plain: predicted only. The predicted world sizes use the smallest run's compute and "
        "codec costs and the largest run's fitted α-β network carried by the ring factors; "
        "10 and 100 Gbit/s scale the fitted per-byte times by the ratio of rates (a model: "
        "gloo's CPU work inside a collective does not shrink with the link).\n\n"
        + header
        + "\n".join(lines)
        + "\n\n## What auto would choose\n\n"
        + ("\n".join(choices) or "(no predicted world size)")
        + "\n"
    )


def _plot(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    models = list(dict.fromkeys(r["model"] for r in rows))
    rates = list(dict.fromkeys(r["rate_bit_s"] for r in rows))
    fig, axes = plt.subplots(
        len(models), len(rates), figsize=(5 * len(rates), 4 * len(models)), squeeze=False
    )
    for i, model in enumerate(models):
        for j, rate in enumerate(rates):
            ax = axes[i][j]
            for codec in dict.fromkeys(r["codec"] for r in rows):
                mine = [
                    r for r in rows
                    if r["model"] == model and r["rate_bit_s"] == rate and r["codec"] == codec
                ]  # fmt: skip
                pred = [(r["nproc"], r["predicted_step_s"]) for r in mine if r["predicted_step_s"]]
                if pred:
                    (line,) = ax.plot(*zip(*pred, strict=True), marker=".", label=codec)
                    meas = [
                        (r["nproc"], r["measured_step_s"]) for r in mine if r["measured_step_s"]
                    ]
                    if meas:
                        ax.plot(*zip(*meas, strict=True), "x", color=line.get_color(), ms=8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("ranks P")
            ax.set_ylabel("step (s): line predicted, x measured")
            ax.set_title(f"{model}, {_rate_name(rate)}")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_extrapolation(
    records: Sequence[dict[str, Any]],
    out_dir: Path,
    compressions: Mapping[str, Compression],
    *,
    predict_nprocs: Sequence[int],
) -> list[Path]:
    """DIR/extrapolation.{json,md,png}; nothing when no ``auto`` record carries its inputs."""
    rows, choices = extrapolation(records, compressions, predict_nprocs=predict_nprocs)
    if not rows:
        return []
    return [
        write_json(out_dir / "extrapolation.json", rows, choices=choices),
        write_markdown(
            out_dir / "extrapolation.md",
            "Step time against world size and link rate",
            _markdown(rows, choices),
        ),
        _plot(rows, out_dir / "extrapolation.png"),
    ]
