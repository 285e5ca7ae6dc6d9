"""The network benchmark across world sizes: how bytes per rank and step times move with P.

A ring all-reduce delivers about ``2 (P-1)/P`` of its input to every rank whatever P is, and so
does the two-phase exchange (all-to-all, then an all-gather of one slice per owner); an
all-gathered codec delivers ``P - 1`` payloads. :func:`scale_lines` checks these against the
measured ``bytes_received_per_rank`` (each rank's interface counters) of a run over several
``--nproc`` values, and the step-time targets at the largest world size:

* bytes received per rank by the two-phase transport at the largest P within 10% of the
  smallest P, while the all-gather codecs grow with ``P - 1``. NOTE: a reduce-then-gather
  exchange (the two-phase one, a ring all-reduce) receives ``2 (P-1)/P`` of its payload per
  rank, the bandwidth-optimal volume (Thakur et al. 2005): 1x at P = 2, 1.75x at P = 8, 2x at
  any P beyond; each line states that prediction beside the measurement;
* at the largest P, 1 Gbit/s, fc-heavy: the best two-phase spec >= 1.5x PyTorch's fp16 hook
  and >= 1.2x the best all-gather codec in step time, and ``auto`` >= 0.97x the best fixed
  choice, all from the same run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from superneurons.codecs.powersgd import PowerSGD
from superneurons.codecs.twophase import TwoPhase
from superneurons.schemes.anchors import TorchDense, TorchFp16, TorchPowerSGD
from superneurons.schemes.auto import Auto
from superneurons.schemes.compose import unwrap
from superneurons.schemes.grammar import Compression

__all__ = ["exchange_kind", "scale_lines"]

_BYTES_TOLERANCE = 0.10
_FP16_TARGET, _GATHER_TARGET, _AUTO_TARGET = 1.5, 1.2, 0.97


def exchange_kind(compression: Compression | None) -> str:
    """How a codec label's gradients travel, from the object it names: ``dense`` (plain DDP),
    ``anchor`` (PyTorch's hooks), ``ring`` (all-reduced: casts, PowerSGD), ``twophase``,
    ``gather`` (all-gathered payloads), ``auto``, or ``unknown`` (None: a label the run's
    configuration does not name)."""
    if compression is None:
        return "unknown"
    base = unwrap(compression).base
    if isinstance(base, TorchDense):
        return "dense"
    if isinstance(base, TorchFp16 | TorchPowerSGD):
        return "anchor"
    if isinstance(base, TwoPhase):
        return "twophase"
    if isinstance(base, PowerSGD):
        return "ring"
    if isinstance(base, Auto):
        return "auto"
    return "ring" if base.summable else "gather"


def _ok(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("status") == "ok"]


def bytes_lines(
    records: Sequence[dict[str, Any]], compressions: Mapping[str, Compression]
) -> list[str]:
    """Per (bandwidth, model, codec) measured at two or more world sizes: bytes received per
    rank at the largest P over the smallest, against what the exchange predicts."""
    lines = []
    groups: dict[tuple[str, str, str], dict[int, float]] = {}
    for r in _ok(records):
        received = r.get("bytes_received_per_rank")
        if received:
            key = (r["bandwidth"], r["model"], r["codec"])
            groups.setdefault(key, {})[int(r.get("nproc", 2))] = float(received)
    for (bandwidth, model, codec), by_p in sorted(groups.items()):
        if len(by_p) < 2:
            continue
        low, high = min(by_p), max(by_p)
        ratio = by_p[high] / by_p[low]
        kind = exchange_kind(compressions.get(codec))
        text = (
            f"- {bandwidth}, {model}, {codec}: {by_p[low] / 1e6:.2f} MB received per rank per "
            f"step at P={low}, {by_p[high] / 1e6:.2f} MB at P={high} ({ratio:.2f}x"
        )
        ring = (2 * (high - 1) / high) / (2 * (low - 1) / low)
        if kind == "twophase":
            met = abs(ratio - 1) <= _BYTES_TOLERANCE
            text += (
                f"; target within 10%: {'met' if met else 'NOT met'}; its all-to-all and "
                f"all-gather predict 2(P-1)/P: {ring:.2f}x, the least any exchange that "
                "reduces and then gathers can move)"
            )
        elif kind == "gather":
            text += f"; all-gather predicts (P-1) growth: {(high - 1) / (low - 1):.2f}x)"
        elif kind in ("dense", "ring", "anchor"):
            text += f"; a ring predicts {ring:.2f}x)"
        else:
            text += ")"
        lines.append(text)
    return lines


def step_lines(
    records: Sequence[dict[str, Any]],
    compressions: Mapping[str, Compression],
    *,
    model: str = "fc-heavy",
) -> list[str]:
    """The step-time targets at the largest world size measured at 1 Gbit/s on ``model``."""
    rows = [r for r in _ok(records) if r["bandwidth"] == "1gbit" and r["model"] == model]
    if not rows:
        return []
    p = max(int(r.get("nproc", 2)) for r in rows)
    step = {r["codec"]: float(r["mean_step_s"]) for r in rows if int(r.get("nproc", 2)) == p}
    kind = {c: exchange_kind(compressions.get(c)) for c in step}
    two = {c: s for c, s in step.items() if kind[c] == "twophase"}
    gather = {c: s for c, s in step.items() if kind[c] == "gather"}
    lines = []
    if two:
        best = min(two, key=two.__getitem__)
        text = f"- P={p}, 1gbit, {model}: best two-phase {best} {two[best]:.3f} s/step"
        if "torch-fp16" in step:
            ratio = step["torch-fp16"] / two[best]
            met = "met" if ratio >= _FP16_TARGET else "NOT met"
            text += f"; {ratio:.2f}x torch-fp16 (target >= {_FP16_TARGET}x: {met})"
        if gather:
            other = min(gather, key=gather.__getitem__)
            ratio = gather[other] / two[best]
            met = "met" if ratio >= _GATHER_TARGET else "NOT met"
            text += f"; {ratio:.2f}x the best all-gather codec {other} (target >= {_GATHER_TARGET}x: {met})"
        lines.append(text)
    fixed = {c: s for c, s in step.items() if kind[c] != "auto"}
    autos = {c: s for c, s in step.items() if kind[c] == "auto"}
    if fixed and autos:
        best = min(fixed, key=fixed.__getitem__)
        for codec, seconds in sorted(autos.items()):
            ratio = fixed[best] / seconds
            met = "met" if ratio >= _AUTO_TARGET else "NOT met"
            lines.append(
                f"- P={p}, 1gbit, {model}: {codec} {seconds:.3f} s/step, {ratio:.2f}x the best "
                f"fixed choice {best} {fixed[best]:.3f} s (target >= {_AUTO_TARGET}x: {met})"
            )
    return lines


def scale_lines(
    records: Sequence[dict[str, Any]], compressions: Mapping[str, Compression]
) -> list[str]:
    """Both checks (empty when the run had one world size); ``compressions``: what each codec
    label names (:attr:`.run.NetworkBenchConfig.compressions`)."""
    if len({int(r.get("nproc", 2)) for r in records}) < 2 and not any(
        int(r.get("nproc", 2)) > 2 for r in records
    ):
        return []
    return bytes_lines(records, compressions) + step_lines(records, compressions)
