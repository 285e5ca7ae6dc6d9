"""The demo's slow link: both arms' ranks talk over the same emulated link, or over loopback
where no link can be made here.

:func:`demo_link` is a context manager over the network benchmark's namespaces
(:func:`superneurons.bench.links.netns.network_namespaces`: a network namespace per rank, a
veth pair shaped with ``tc tbf`` in both directions). Everything it creates lives inside
namespaces named ``sn-<pid>-<run>-...`` (the qdiscs, and for more than 2 ranks the bridge) and is
deleted on leaving: normally, on an exception, on Ctrl-C and on SIGTERM. Where shaping is
impossible (not root, no ``ip``/``tc``, not Linux) it yields a loopback link whose
``loopback_reason`` says why, and the demo says so in its report's first line.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from superneurons.bench.links.netns import (
    Topology,
    check_prerequisites,
    check_shaping_rate,
    measure_throughput_bit_s,
    network_namespaces,
)
from superneurons.errors import ConfigError
from superneurons.rates import format_rate

__all__ = ["DemoLink", "demo_link"]

log = logging.getLogger("superneurons.demo")


@dataclass(frozen=True)
class DemoLink:
    """Where the demo's ranks run.

    Attributes:
        rate_bit_s: the stated rate of the link.
        topology: the shaped namespaces; None on loopback.
        measured_bit_s: the link's TCP goodput, measured once (None on loopback).
        loopback_reason: why the ranks run on loopback instead (None when shaped).
    """

    rate_bit_s: int
    topology: Topology | None = None
    measured_bit_s: float | None = None
    loopback_reason: str | None = None

    @property
    def shaped(self) -> bool:
        return self.topology is not None

    def describe(self) -> str:
        """One line: the link, as measured, or why there is none."""
        if self.topology is None:
            return f"loopback, unshaped ({self.loopback_reason})"
        measured = (
            ""
            if self.measured_bit_s is None
            else f", {self.measured_bit_s / 1e6:.1f} Mbit/s of TCP goodput measured"
        )
        return (
            f"{format_rate(self.rate_bit_s)} each way between {self.topology.nproc} ranks "
            f"(a network namespace per rank, tc tbf on a veth pair{measured})"
        )


@contextlib.contextmanager
def demo_link(
    rate_bit_s: int, nproc: int, *, shaping: bool = True, measure: bool = True
) -> Iterator[DemoLink]:
    """The link both arms train over: ``nproc`` namespaces linked at ``rate_bit_s``, deleted
    on exit (also on an exception, Ctrl-C or SIGTERM); loopback where they cannot be made or
    with ``shaping=False``.

    Raises:
        ConfigError: ``rate_bit_s`` below what tbf can shape; a command failed while the
            namespaces were being built (whatever was built is deleted first).
    """
    check_shaping_rate(rate_bit_s)
    reason = "--no-shaping" if not shaping else _why_not_shaped(nproc)
    if reason is not None:
        log.warning("the demo's ranks run on loopback: %s", reason)
        yield DemoLink(rate_bit_s, loopback_reason=reason)
        return
    with network_namespaces(nproc, rate_bit_s=rate_bit_s) as topology:
        measured = measure_throughput_bit_s(topology, seconds=1.0) if measure else None
        yield DemoLink(rate_bit_s, topology, measured)


def _why_not_shaped(nproc: int) -> str | None:
    """Why this machine cannot shape a link for ``nproc`` ranks (None: it can)."""
    if nproc < 2:
        return "one rank has no link to shape"
    try:
        check_prerequisites()
    except ConfigError as exc:
        return str(exc).split(":")[0]
    return None
