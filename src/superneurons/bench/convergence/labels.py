"""The convergence benchmark's codec labels: what each label means and on which tasks it runs.

A label is ``dense``; a gradient-hook spec (``fft``, ``powersgd:rank=4``, ``auto``), optionally
with a θ schedule after ``|`` (``fft|diminishing:start=0.99,floor=0.9,drops=4,until=0.5``:
:class:`~superneurons.codecs.schedule.DiminishingTheta`, HPDC'20's two θ claims); an
optimizer-side spec ``adam-momentum[...]:SPEC`` / ``adam-update[...]:SPEC``
(:class:`~superneurons.optim.adam.CompressedAdamW`); or, on Adam tasks, ``auto`` /
``auto:link=RATE`` (:mod:`superneurons.optim.autoadam`: dense AdamW or 1-bit Adam, chosen by
the cost model; ``link=`` plans for a stated link instead of the measured one); or DiLoCo,
``diloco[steps=H,...]:SPEC`` (a ``train --sync`` spec; error feedback added to a lossy wire).
"""

from __future__ import annotations

from typing import Any

from superneurons.errors import ConfigError

__all__ = ["adam_auto", "applies", "check_label", "scheme_of", "split_label", "theta_schedule"]


def scheme_of(optimizer: str, label: str) -> Any:
    """The object ``label``'s spec names on a task with ``optimizer`` (``auto`` is
    :class:`~superneurons.schemes.adam.AdamAuto` with Adam/AdamW; ``diloco...`` is
    :class:`~superneurons.schemes.diloco.DiLoCo`); None for ``dense``."""
    from superneurons.schemes.grammar import parse_scheme

    spec = split_label(label)[0]
    if spec.startswith("diloco"):
        return _diloco(spec)
    return None if spec == "dense" else parse_scheme(spec, adam=optimizer != "sgd")


def adam_auto(optimizer: str, label: str) -> Any:
    """The :class:`~superneurons.schemes.adam.AdamAuto` of ``label`` on an Adam task,
    else None (``auto`` on an SGD task is the gradient hook's)."""
    return None if optimizer == "sgd" else _adam_auto_or_none(split_label(label)[0])


def _adam_auto_or_none(spec: str) -> Any:
    """``auto[:link=..,margin=..]`` -> AdamAuto; anything else (``auto:observe_steps=3`` is
    the gradient hook's ``auto``) -> None."""
    from superneurons.schemes.adam import AdamAuto

    try:
        scheme = scheme_of("adam", spec)
    except ConfigError:
        return None
    return scheme if isinstance(scheme, AdamAuto) else None


def _diloco(spec: str) -> Any:
    """A DiLoCo label as ``train --sync`` reads it: error feedback around a lossy wire."""
    from dataclasses import replace

    from superneurons.schemes.compose import with_defaults
    from superneurons.schemes.diloco import DiLoCo
    from superneurons.schemes.grammar import parse_sync

    sync = parse_sync(spec)
    if not isinstance(sync, DiLoCo) or sync.inner is None:
        return sync
    return replace(sync, inner=with_defaults(sync.inner))


def split_label(label: str) -> tuple[str, dict[str, float] | None]:
    """``"SPEC|diminishing:k=v,..."`` -> (SPEC, schedule options) ; no suffix -> None."""
    spec, bar, schedule = label.partition("|")
    if not bar:
        return spec, None
    name, _, rest = schedule.partition(":")
    if name != "diminishing":
        raise ConfigError(f"{label!r}: the schedule after '|' must be 'diminishing:...'")
    options: dict[str, float] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in ("start", "floor", "drops", "until"):
            raise ConfigError(f"{label!r}: options are start, floor, drops, until; got {item!r}")
        options[key] = float(value)
    return spec, options


def check_label(label: str) -> None:
    """Raise :class:`ConfigError` for a label no task can run (before any rank starts)."""
    spec, schedule = split_label(label)
    if spec in ("dense", "auto"):
        return  # "auto" on SGD is resolved by register_compression (the hook branch)
    if spec.startswith(("adam-", "diloco")):
        scheme_of("adam", spec)  # raises for a bad one
        return
    if spec.startswith("auto:") and _adam_auto_or_none(spec) is not None:
        return  # auto:link=RATE: Adam tasks only (see applies)
    from superneurons.bench.network.run import check_codec

    check_codec(spec)
    if schedule is not None:
        theta_schedule(schedule, 1)


def applies(optimizer: str, label: str) -> bool:
    """Optimizer-side labels (``adam-*``, ``auto:link=...``) replace Adam/AdamW: not run on
    SGD tasks."""
    if optimizer != "sgd":
        return True
    spec = split_label(label)[0]
    return not spec.startswith("adam-") and not (
        spec.startswith("auto:") and _adam_auto_or_none(spec) is not None
    )


def theta_schedule(options: dict[str, float], total: int) -> Any:
    from superneurons.codecs.schedule import DiminishingTheta

    until = options.get("until", 1.0)
    if not 0.0 < until <= 1.0:
        raise ConfigError(f"diminishing: until is a fraction of the run in (0, 1], got {until}")
    return DiminishingTheta(
        start=options.get("start", 0.99),
        floor=options.get("floor", 0.9),
        steps=max(1, round(until * total)),
        drops=int(options.get("drops", 4)),
    )
