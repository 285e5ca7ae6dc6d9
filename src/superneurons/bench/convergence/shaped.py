"""The convergence benchmark over a shaped link: each rank in its own network namespace.

``superneurons bench convergence --bandwidth 100mbit`` trains the same codecs as on loopback,
but the ranks talk through veth links rate-limited by ``tc tbf``
(:func:`superneurons.bench.links.netns.network_namespaces`, the network benchmark's machinery), so
``auto`` measures a network where compression can pay. Needs root (namespaces); the ranks
are subprocesses started with ``ip netns exec`` (``python -m superneurons.bench.convergence.rank``
is one rank).
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from superneurons.errors import ConfigError

__all__ = ["run_ranks_shaped"]

_PORT = 29517


def run_ranks_shaped(config: Any, out: Path, poll: Callable[[], None]) -> None:
    """Run every rank of ``config`` (a ``ConvergenceConfig`` with ``bandwidth_bit_s``) in its
    own namespace; ``poll()`` is called about once a second while they train.

    Raises:
        ConfigError: no namespaces here (not root, no ``ip``/``tc``), or a rank failed.
    """
    from superneurons.bench.links.netns import network_namespaces

    config_path = out.with_suffix(".config.pickle")
    config_path.write_bytes(pickle.dumps(config))
    with network_namespaces(config.nproc, rate_bit_s=config.bandwidth_bit_s) as topology:
        procs = []
        for rank in range(config.nproc):
            argv = [sys.executable, "-m", "superneurons.bench.convergence.rank", str(config_path)]
            argv += [str(rank), str(_PORT), str(out), topology.addresses[0]]
            argv.append(topology.interfaces[rank])
            procs.append(subprocess.Popen([*topology.exec_prefix(rank), *argv]))
        try:
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs):
                    break
                poll()
                time.sleep(1.0)
        finally:  # never leave ranks running in namespaces being deleted
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            codes = [proc.wait() for proc in procs]
    if any(codes):
        raise ConfigError(f"convergence ranks over the shaped link failed (exit codes {codes})")
