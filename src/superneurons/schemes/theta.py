"""θ over a whole run: the grammar's ``RUN`` production, what a benchmark's codec label names.

::

    RUN    := SYNC | SPEC ["|" THETA]      e.g. fft:theta=0.999|diminishing:floor=0.9,until=0.5
    THETA  := "diminishing" [":" OPTION ("," OPTION)*]   options start, floor, drops, until

``SPEC`` and ``SYNC`` are :mod:`.grammar`'s (:func:`~.grammar.parse_scheme`,
:func:`~.grammar.parse_sync`; the first NAME tells them apart). ``THETA`` is HPDC'20's
diminishing θ (Wang et al., arXiv 1811.08596: a diminishing θ keeps convergence) stated as a
fraction of the run rather than in steps, because a label is read before the run's length is
known: :class:`Diminishing` falls from ``start`` to ``floor`` in ``drops`` equal drops over the
first ``until`` of the run. :meth:`RunScheduled.at` gives the hook's
:class:`~superneurons.codecs.schedule.Scheduled` once the number of steps is. ``str(obj)``
parses back to an equal object.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from superneurons.codecs.canonical import Canonical
from superneurons.codecs.schedule import DiminishingTheta, Scheduled
from superneurons.errors import ConfigError
from superneurons.schemes.adam import AdamAuto, AdamMomentum, AdamUpdate
from superneurons.schemes.compose import unwrap
from superneurons.schemes.diloco import Sync
from superneurons.schemes.grammar import (
    SYNCS,
    Compression,
    Scheme,
    parse_options,
    parse_scheme,
    parse_sync,
)

__all__ = ["THETAS", "THETA_GRAMMAR", "Diminishing", "Run", "RunScheduled", "parse_run"]

THETA_GRAMMAR = "diminishing[:start=S,floor=F,drops=D,until=U] (until: a fraction of the run)"


@dataclass(frozen=True)
class Diminishing(Canonical):
    """θ from ``start`` down to ``floor`` in ``drops`` equal drops over the first ``until`` of
    the run (a fraction in (0, 1]), then ``floor``: a
    :class:`~superneurons.codecs.schedule.DiminishingTheta` whose steps follow the run."""

    start: float = 0.99
    floor: float = 0.9
    drops: int = 4
    until: float = 1.0
    NAME: ClassVar[str] = "diminishing"

    def __post_init__(self) -> None:
        if isinstance(self.until, bool) or not 0.0 < self.until <= 1.0:
            raise ConfigError(
                f"diminishing: until is a fraction of the run in (0, 1], got {self.until}"
            )
        self.over(1)  # start, floor and drops are checked by DiminishingTheta

    def over(self, total_steps: int) -> DiminishingTheta:
        """The schedule in steps, for a run of ``total_steps``."""
        steps = max(1, round(self.until * total_steps))
        return DiminishingTheta(start=self.start, floor=self.floor, steps=steps, drops=self.drops)


THETAS: dict[str, type[Diminishing]] = {"diminishing": Diminishing}


@dataclass(frozen=True)
class RunScheduled:
    """``inner`` (an fft or topk compression, possibly wrapped) with its θ following
    ``schedule`` over the run: ``SPEC|THETA``."""

    inner: Compression
    schedule: Diminishing

    def __post_init__(self) -> None:
        if isinstance(self.inner, AdamMomentum | AdamUpdate | AdamAuto):
            raise ConfigError(
                f"{self.inner.spec!r} is an optimizer scheme; a θ schedule drives the θ of a "
                "gradient codec (fft, topk)"
            )
        unwrap(self.at(1))  # raises ConfigError unless inner has a θ to schedule

    def at(self, total_steps: int) -> Scheduled:
        """What the DDP hook runs for a run of ``total_steps``."""
        return Scheduled(self.inner, self.schedule.over(total_steps))

    @property
    def spec(self) -> str:
        return f"{self.inner.spec}|{self.schedule.spec}"

    def __str__(self) -> str:
        return self.spec


# What a run's label names (see the module docstring).
Run = Scheme | RunScheduled | Sync


def parse_run(text: str, *, adam: bool) -> Run:
    """The object a run's label names: a ``train --sync`` spec, or a ``--compress`` spec
    (``adam``: as with an Adam-family optimizer, see :func:`~.grammar.parse_scheme`) with an
    optional θ schedule over the run after ``|``.

    Raises:
        ConfigError: as the grammar, or a schedule other than :data:`THETA_GRAMMAR`, or one
            around a compression without a θ (only fft and topk have one).
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"empty label; expected a spec, optionally followed by |{THETA_GRAMMAR}")
    head = re.match(r"\s*([\w-]*)", text).group(1)  # type: ignore[union-attr]
    if head.lower() in SYNCS:
        return parse_sync(text)
    spec, bar, theta = text.partition("|")
    scheme = parse_scheme(spec, adam=adam)
    if not bar:
        return scheme
    name, colon, options = (part.strip() for part in theta.partition(":"))
    cls = THETAS.get(name.lower())
    if cls is None or (colon and not options):
        raise ConfigError(f"{text!r}: after '|' comes a θ schedule over the run, {THETA_GRAMMAR}")
    items = options.split(",") if options else []
    return RunScheduled(scheme, cls(**parse_options(cls.NAME, cls, items, text)))  # type: ignore[arg-type]
