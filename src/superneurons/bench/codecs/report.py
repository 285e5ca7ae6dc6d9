"""Artifacts of the codec benchmark on real gradients (:mod:`.budgets`): the records, each
equally coded sparsifier's error over compactly coded Top-k's per model and budget (the
verdicts) with their geometric means, as JSON, Markdown tables and a PNG of error against bits.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from superneurons.bench.artifacts import markdown_table, pyplot, write_json, write_markdown
from superneurons.bench.codecs.budgets import SPARSE_FAMILIES

__all__ = ["verdict_summary", "write_codec_artifacts"]

_REFERENCE = "ctopk"  # the fair baseline every verdict ratio divides by


def _verdicts(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and budget: each equally coded sparsifier's error (one-shot and after error
    feedback) and its ratio to compactly coded Top-k's (< 1: lower error than ``ctopk``)."""
    rows = []
    cells = dict.fromkeys(
        (r["model"], r["budget_bits"]) for r in records if r["codec"] == _REFERENCE
    )
    for model, budget in cells:
        here = {
            r["family"]: r
            for r in records
            if r["model"] == model and r["budget_bits"] == budget and r["family"] in SPARSE_FAMILIES
        }
        ref = here[_REFERENCE]
        row: dict[str, Any] = {"model": model, "budget_bits": budget}
        for family, record in here.items():
            row[f"{family}_error"] = record["rel_error"]
            row[f"{family}_ef_error"] = record["ef_rel_error"]
            if family != _REFERENCE:
                row[f"{family}/ctopk"] = record["rel_error"] / ref["rel_error"]
                row[f"{family}/ctopk_ef"] = record["ef_rel_error"] / ref["ef_rel_error"]
        rows.append(row)
    return rows


def verdict_summary(verdicts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per family: geometric mean of its error ratio to ``ctopk`` (one-shot and after error
    feedback) over every model x budget cell, and in how many cells it is lower (or equal)."""
    summary: dict[str, Any] = {}
    for family in SPARSE_FAMILIES:
        if family == _REFERENCE:
            continue
        for key in (f"{family}/ctopk", f"{family}/ctopk_ef"):
            ratios = [row[key] for row in verdicts if key in row and row[key] > 0]
            if ratios:
                summary[key] = {
                    "geomean": math.exp(statistics.fmean(math.log(x) for x in ratios)),
                    "lower_in": sum(x < 1 for x in ratios),
                    # exactly equal errors: e.g. both send every nonzero coefficient and only
                    # the shared value coding's quantisation is left
                    "equal_in": sum(x == 1 for x in ratios),
                    "cells": len(ratios),
                    "max": max(ratios),
                }
    return summary


def write_codec_artifacts(
    records: Sequence[dict[str, Any]], out_dir: Path, **extra: Any
) -> dict[str, Path]:
    """``codecs.json`` (records + verdicts), ``codecs.md`` (tables) and ``codecs.png``."""
    out_dir = Path(out_dir)
    verdicts = _verdicts(records)
    summary = verdict_summary(verdicts)
    json_path = write_json(
        out_dir / "codecs.json", records, verdicts=verdicts, summary=summary, **extra
    )
    columns = ["model", "budget_bits", "spec", "bits_per_element", "rel_error", "cosine",
               "ef_rel_error", "noef_rel_error", "encode_gbps", "decode_gbps"]  # fmt: skip
    verdict_columns = ["model", "budget_bits"]
    for family in SPARSE_FAMILIES:
        verdict_columns += [f"{family}_error", f"{family}_ef_error"]
    for family in SPARSE_FAMILIES:
        if family != _REFERENCE:
            verdict_columns += [f"{family}/ctopk", f"{family}/ctopk_ef"]
    summary_rows = [{"ratio": key, **value} for key, value in summary.items()]
    body = (
        "Relative error ||g_hat - g|| / ||g|| on real gradients (mean over capture points), "
        "bits per element counting every payload byte, 4 MiB DDP-style buckets. "
        "`ef_rel_error` / `noef_rel_error`: error of the update accumulated over K consecutive "
        "gradients with / without error feedback. GB/s: fp32 input bytes per second, one "
        "thread, median; timings taken on a shared, contended machine.\n\n"
        "## Equal coding: each sparsifier's error over compactly coded Top-k's "
        "(ratio < 1: lower error than ctopk)\n\n"
        + markdown_table(verdicts, verdict_columns)
        + "\n## Geometric means over every model x budget cell\n\n"
        + markdown_table(summary_rows, ["ratio", "geomean", "lower_in", "equal_in", "cells", "max"])
        + "\n## All settings\n\n"
        + markdown_table(records, columns)
    )
    md_path = write_markdown(out_dir / "codecs.md", "Codec benchmark on real gradients", body)
    png_path = _plot(records, out_dir / "codecs.png")
    return {"json": json_path, "markdown": md_path, "png": png_path}


def _plot(records: Sequence[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    models = list(dict.fromkeys(r["model"] for r in records))
    cols = min(2, len(models))
    rows = -(-len(models) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.5 * rows), squeeze=False)
    for ax, model in zip(axes.flat, models, strict=False):
        mine = [r for r in records if r["model"] == model and r["rel_error"] > 0]
        for family in dict.fromkeys(r["family"] for r in mine):
            points = sorted(
                (r["bits_per_element"], r["rel_error"]) for r in mine if r["family"] == family
            )
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", label=family)
        for budget in sorted({r["budget_bits"] for r in mine if r["budget_bits"]}):
            ax.axvline(budget, color="0.85", linewidth=0.8, zorder=0)
        ax.set(xscale="log", yscale="log", title=model, xlabel="bits per element (wire)",
               ylabel="relative error ||ĝ-g||/||g||")  # fmt: skip
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(models) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
