"""Starting ranks: re-launch through torchrun.

``superneurons train`` (the launcher) validates its flags, checks the backend against this
node's GPUs (:func:`check_launch`), writes ``OUT/config.json`` and runs torchrun's elastic
agent in its own process (no second interpreter) on ``... -m superneurons.commands.rank
OUT/config.json`` (:func:`torchrun_command`: also the command line to run by hand); each rank
then joins the process group (:func:`superneurons.train.rank.init_distributed`) and calls
:func:`superneurons.train.loop.train`. Single node by default (c10d rendezvous on a free
localhost port); ``--nnodes/--node-rank/--rdzv-endpoint`` or ``--master-addr/--master-port``
pass through for several machines, and ``--max-restarts N`` to torchrun's elastic agent: when a
rank fails, the agent stops the others and restarts all of them (up to N times), and the
restarted ranks resume from the newest common checkpoint (:mod:`superneurons.train.loop`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.context
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from superneurons.device import BackendChoice, choose_backend
from superneurons.errors import ConfigError
from superneurons.randomness import python_random_kept

__all__ = [
    "RANK_ENTRY",
    "RANK_PRELOAD",
    "Launch",
    "check_launch",
    "forkserver_for_ranks",
    "free_port",
    "run_torchrun",
    "torchrun_arguments",
    "torchrun_command",
    "under_torchrun",
]

logger = logging.getLogger("superneurons.train")

# The module torchrun runs in every rank (``python -m RANK_ENTRY OUT/config.json``).
RANK_ENTRY = "superneurons.commands.rank"


@dataclass(frozen=True)
class Launch:
    """How many processes, on how many machines, meeting where."""

    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # host:port of the c10d rendezvous
    master_addr: str | None = None  # static rendezvous instead (with master_port)
    master_port: int = 29500
    max_restarts: int = 0  # torchrun restarts every worker after a failure, this many times

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {self.nproc}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank must be in [0, --nnodes), got {self.node_rank} of {self.nnodes}"
            )
        if self.nnodes > 1 and self.rdzv_endpoint is None and self.master_addr is None:
            raise ConfigError("several nodes need --rdzv-endpoint HOST:PORT or --master-addr")


def under_torchrun() -> bool:
    """True inside a rank started by torchrun (it sets these variables)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


# What a server of local ranks imports before it forks them: torch, its process groups and the
# compiler stack that constructing any torch optimizer imports. Under "spawn" every rank
# imported them itself: about 5.5 CPU-s a rank on a 2-core machine, half of it that stack.
RANK_PRELOAD = ("torch", "torch.distributed", "torch._dynamo")


def forkserver_for_ranks(*modules: str) -> multiprocessing.context.ForkServerContext:
    """multiprocessing's "forkserver" context, its server preloading :data:`RANK_PRELOAD` and
    ``modules`` (the rank's own): local ranks started from it fork from one process that
    imported them once (CUDA-safe as "spawn": the server touches no device). The server starts
    with the first process and serves this process's later ones with the environment it
    started with; a preload set after it started changes nothing."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*RANK_PRELOAD, *modules])
    return ctx


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (the one helper for local ranks).

    Chosen at random below the kernel's ephemeral range (``ip_local_port_range``), so that no
    outgoing connection (gloo's own pair connections, another job's) can be given it between
    this check and the rank that binds it, and two callers at once rarely meet; a port taken
    now is skipped. Falls back to one the kernel picks where that range cannot be read.
    """
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text(encoding="ascii")
        ephemeral_low = int(text.split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    chooser = random.Random(os.getpid() ^ time.monotonic_ns())
    if ephemeral_low > 20000:
        for _ in range(64):
            port = chooser.randrange(20000, ephemeral_low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check_launch(launch: Launch, backend: str) -> BackendChoice:
    """The backend this node's ranks will use, decided before any starts (the ranks decide
    again with the same function and the same inputs). Raises ConfigError for ``nccl`` without
    a GPU per rank; ``auto`` with too few GPUs gives gloo and a one-line note to show."""
    return choose_backend(backend, local_world_size=launch.nproc)


def torchrun_command(
    launch: Launch, config_path: Path, *, log_dir: Path | None = None
) -> list[str]:
    """The torchrun command line that runs every rank of this node on ``config_path``;
    ``log_dir``: the folder torchrun's agent makes its per-attempt folders in (None: a new
    ``torchelastic_*`` folder under the system's temporary directory, never removed)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *torchrun_arguments(launch, config_path, log_dir=log_dir),
    ]


def torchrun_arguments(
    launch: Launch, config_path: Path, *, log_dir: Path | None = None
) -> list[str]:
    """:func:`torchrun_command`'s arguments after ``python -m torch.distributed.run``."""
    arguments = ["--nproc-per-node", str(launch.nproc)]
    arguments += ["--nnodes", str(launch.nnodes), "--node-rank", str(launch.node_rank)]
    arguments += ["--max-restarts", str(launch.max_restarts)]
    if log_dir is not None:
        arguments += ["--log-dir", str(log_dir)]
    if launch.master_addr is not None:
        arguments += ["--master-addr", launch.master_addr, "--master-port", str(launch.master_port)]
    else:
        endpoint = launch.rdzv_endpoint or f"localhost:{free_port()}"
        arguments += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    return [*arguments, "-m", RANK_ENTRY, str(config_path)]


def run_torchrun(launch: Launch, config_path: Path) -> int:
    """Run the ranks of this node; their exit status (0 when all succeeded; else the lowest
    failed rank's positive status, or 1 when the ranks died of signals). The agent's
    per-attempt folders go to a temporary folder removed when the ranks end (also on Ctrl-C).

    NOTE: torchrun's elastic agent runs in this process (what ``torchrun``'s own ``main``
    does), not in a fresh interpreter: that one would import torch again before any rank
    starts (about 3.5 s of CPU per launch here). What the agent changes in this process is
    this call's only and restored after: its signal handlers, the ``OMP_NUM_THREADS`` it gives
    the ranks and the ``TORCHELASTIC_SIGNALS_TO_HANDLE`` it sets, and Python's global random
    state (its rendezvous draws delays from it).
    """
    with tempfile.TemporaryDirectory(prefix="superneurons-torchrun-") as logs:
        arguments = torchrun_arguments(launch, config_path, log_dir=Path(logs))
        logger.info("launching: torchrun %s", " ".join(arguments))
        agent_sets = dict.fromkeys(_AGENT_ENVIRON, None)
        with (
            _environ(**agent_sets, OMP_NUM_THREADS="1"),
            _signal_handlers_kept(),
            python_random_kept(),
        ):
            return _run_agent(arguments)


def _run_agent(torchrun_args: list[str]) -> int:
    """torchrun's agent on ``torchrun_args`` in this process: 0, or a failed rank's status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    config, entrypoint, entry_args = config_from_args(parse_args(torchrun_args))
    try:
        elastic_launch(config=config, entrypoint=entrypoint)(*entry_args)
    except ChildFailedError as failed:
        logger.error("%s", failed.format_msg())
        codes = [f.exitcode for _, f in sorted(failed.failures.items()) if f.exitcode]
        return codes[0] if codes and codes[0] > 0 else 1
    except SignalException as stopped:  # the agent has stopped every rank by now
        if stopped.sigval == signal.SIGINT:
            raise KeyboardInterrupt from stopped
        return 128 + int(stopped.sigval)
    return 0


# NOTE: torch.distributed.launcher.api.launch_agent sets it in the launching process.
_AGENT_ENVIRON = ("TORCHELASTIC_SIGNALS_TO_HANDLE",)


@contextlib.contextmanager
def _environ(**values: str | None) -> Iterator[None]:
    """``os.environ`` with ``values`` set inside the block (None: as it is), as it was after."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update({key: value for key, value in values.items() if value is not None})
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_AGENT_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """The agent installs handlers for its death signals and never restores them."""
    if threading.current_thread() is not threading.main_thread():
        yield  # the agent installs none off the main thread
        return
    before = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
