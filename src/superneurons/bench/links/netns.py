"""Real, shaped networks between training ranks: Linux network namespaces joined by veth links
whose egress is rate-limited with a token-bucket filter (``tc qdisc ... tbf``).

Gradient compression only pays when the wire is the bottleneck (Wang et al., HPDC'20, measure
over a real interconnect; Agarwal et al., MLSys'22, find it rarely pays on fast links), so the
network benchmark runs each rank in its own namespace behind a link of a chosen rate instead of
on loopback. Everything lives inside namespaces we create: two ranks get one direct veth pair;
more ranks get one veth each into a private bridge namespace. Nothing is added to the host's
own namespace, and private addresses (``10.250.x.y/24``) never leave our namespaces.

Every namespace is named ``sn-<pid>-<run>-<role>`` and is always deleted: on normal exit, on an
exception in the body, on Ctrl-C and on SIGTERM; :func:`cleanup_stale_namespaces` removes those
left by a crashed earlier run (whose pid is gone). Only ``tbf`` and ``htb`` exist on the machine
this was written on (no ``netem``), so links have a rate but no added delay.

Measured here with :func:`measure_throughput_bit_s` (2 cores, contended): 1 Gbit/s shapes to
~911 Mbit/s of TCP goodput, 100 Mbit/s to 86-90 Mbit/s.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import FrameType

from superneurons.errors import ConfigError
from superneurons.rates import format_rate

__all__ = [
    "Topology",
    "cleanup_stale_namespaces",
    "check_prerequisites",
    "check_shaping_rate",
    "measure_throughput_bit_s",
    "network_namespaces",
]

log = logging.getLogger("superneurons.bench.netns")

_PREFIX = "sn-"
_NAME_RE = re.compile(r"^sn-(\d+)-\d+-[a-z0-9]+$")
_MIN_RATE_BIT_S = 8_000
_RUN_COUNTER = itertools.count()
# NOTE: tbf needs a bucket of at least rate/HZ bytes or it cannot reach its rate; 10 ms of
# traffic (>= 64 KiB) reached 86-91% of the nominal rate here as TCP goodput.
_BURST_S = 0.010
_MIN_BURST_BYTES = 64 * 1024


def check_shaping_rate(rate_bit_s: int) -> int:
    """``rate_bit_s`` when tbf can shape a link to it (at least 8kbit), else a ConfigError."""
    if rate_bit_s < _MIN_RATE_BIT_S:
        raise ConfigError(
            f"bandwidth {format_rate(rate_bit_s)} is below 8kbit: choose a larger rate"
        )
    return rate_bit_s


@dataclass(frozen=True)
class Topology:
    """The namespaces of one run: rank ``k`` lives in ``namespaces[k]`` and is reachable at
    ``addresses[k]`` through its interface ``interfaces[k]``."""

    namespaces: tuple[str, ...]
    addresses: tuple[str, ...]
    interfaces: tuple[str, ...]
    hub: str | None
    rate_bit_s: int | None

    @property
    def nproc(self) -> int:
        return len(self.namespaces)

    def exec_prefix(self, rank: int) -> list[str]:
        """Command prefix that runs a program inside rank ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[rank]]


def check_prerequisites() -> None:
    """Raise a ConfigError that says what to do unless we are root with ``ip`` and ``tc``."""
    if not sys.platform.startswith("linux"):
        raise ConfigError("network namespaces need Linux; use --no-shaping (loopback) elsewhere")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ConfigError(
            f"{' and '.join(missing)} not found: install iproute2 (apt-get install iproute2), "
            "or run with --no-shaping on loopback"
        )
    if os.geteuid() != 0:
        raise ConfigError(
            "creating network namespaces needs root: run as root (e.g. sudo -E), "
            "or use --no-shaping to run the ranks on loopback without a shaped link"
        )


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(argv: Sequence[str]) -> None:
    proc = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ConfigError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.returncode}")


def _list_namespaces() -> list[str]:
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _delete_namespaces(names: Sequence[str]) -> list[str]:
    """Delete ``names`` (each attempted independently); returns those that failed."""
    failed = []
    for name in names:
        proc = subprocess.run(
            ["ip", "netns", "delete", name], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0 and name in _list_namespaces():
            log.error("could not delete namespace %s: %s", name, proc.stderr.strip())
            failed.append(name)
    return failed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale_namespaces() -> list[str]:
    """Delete namespaces ``sn-<pid>-...`` left by a run of ours whose process is gone.

    Namespaces of live processes (other runs in progress) and anyone else's are left alone.
    Returns the names deleted.
    """
    stale = []
    for name in _list_namespaces():
        match = _NAME_RE.match(name)
        if match is not None and not _pid_alive(int(match.group(1))):
            stale.append(name)
    if stale:
        log.warning("removing %d stale namespace(s) of a crashed run: %s", len(stale), stale)
        _delete_namespaces(stale)
    return stale


def _shape(namespace: str, device: str, rate_bit_s: int, latency_ms: float) -> None:
    burst_bytes = max(_MIN_BURST_BYTES, int(rate_bit_s / 8 * _BURST_S))
    _ip(
        "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
        "rate", f"{rate_bit_s}bit", "burst", str(burst_bytes), "latency", f"{latency_ms}ms",
    )  # fmt: skip


def _build(
    names: Sequence[str], hub: str | None, subnet: int, rate_bit_s: int | None, latency_ms: float
) -> Topology:
    nproc = len(names)
    for name in [*names, *([hub] if hub else [])]:
        _ip("netns", "add", name)
        _ip("-n", name, "link", "set", "lo", "up")
    interfaces = tuple(f"snv{rank}" for rank in range(nproc))
    addresses = tuple(f"10.250.{subnet}.{rank + 1}" for rank in range(nproc))
    shaped: list[tuple[str, str]] = []
    if hub is None:  # two ranks: one direct veth pair, nothing else
        _ip("-n", names[0], "link", "add", interfaces[0], "type", "veth",
            "peer", "name", interfaces[1], "netns", names[1])  # fmt: skip
        shaped += [(names[0], interfaces[0]), (names[1], interfaces[1])]
    else:  # a private bridge in the hub namespace, one veth per rank
        _ip("-n", hub, "link", "add", "snbr", "type", "bridge")
        _ip("-n", hub, "link", "set", "snbr", "up")
        for rank, name in enumerate(names):
            port = f"snh{rank}"
            _ip("-n", hub, "link", "add", port, "type", "veth",
                "peer", "name", interfaces[rank], "netns", name)  # fmt: skip
            _ip("-n", hub, "link", "set", port, "master", "snbr")
            _ip("-n", hub, "link", "set", port, "up")
            shaped += [(name, interfaces[rank]), (hub, port)]  # rank's upload, then download
    for rank, name in enumerate(names):
        _ip("-n", name, "addr", "add", f"{addresses[rank]}/24", "dev", interfaces[rank])
        _ip("-n", name, "link", "set", interfaces[rank], "up")
    if rate_bit_s is not None:
        for namespace, device in shaped:
            _shape(namespace, device, rate_bit_s, latency_ms)
    return Topology(tuple(names), addresses, interfaces, hub, rate_bit_s)


class _Interrupted(BaseException):
    """Raised from our SIGTERM handler so ``finally`` blocks run, then re-raised as exit."""


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """Turn SIGTERM (and an ignored SIGINT) into exceptions while the namespaces exist, so the
    cleanup in ``finally`` always runs; previous handlers are restored afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers can only be installed from the main thread; try/finally still holds
        return

    def on_term(signum: int, _frame: FrameType | None) -> None:
        raise _Interrupted(signum)

    def on_int(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_int)
    try:
        yield
    except _Interrupted as exc:
        raise SystemExit(128 + int(exc.args[0])) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def network_namespaces(
    nproc: int = 2, *, rate_bit_s: int | None = None, latency_ms: float = 50.0
) -> Iterator[Topology]:
    """Create ``nproc`` namespaces linked at ``rate_bit_s`` (None: unshaped); delete them on exit.

    Example::

        with network_namespaces(2, rate_bit_s=parse_rate("100mbit")) as topo:
            subprocess.run([*topo.exec_prefix(1), "python", "-m", "worker", topo.addresses[0]])

    Args:
        nproc: number of ranks (>= 2); 2 ranks share one veth pair, more join a private bridge.
        rate_bit_s: egress rate of every link end (both directions are shaped).
        latency_ms: tbf queue bound: packets that would wait longer are dropped.

    Raises:
        ConfigError: not root, ``ip``/``tc`` missing, bad arguments, or a command failed.
    """
    if nproc < 2:
        raise ConfigError(f"nproc must be >= 2 to have a network, got {nproc}")
    if nproc > 250:
        raise ConfigError(f"nproc must be <= 250 (one /24 subnet), got {nproc}")
    if latency_ms <= 0:
        raise ConfigError(f"latency_ms must be positive, got {latency_ms}")
    check_prerequisites()
    cleanup_stale_namespaces()
    run = next(_RUN_COUNTER)
    base = f"{_PREFIX}{os.getpid()}-{run}"
    names = [f"{base}-r{rank}" for rank in range(nproc)]
    hub = f"{base}-hub" if nproc > 2 else None
    created = [*names, *([hub] if hub else [])]
    with _signals_raise():
        try:
            topology = _build(names, hub, run % 256, rate_bit_s, latency_ms)
            log.info("namespaces %s at %s", created, format_rate(rate_bit_s or 0) or "unshaped")
            yield topology
        finally:
            # Hold signals while deleting so a second Ctrl-C cannot leave namespaces behind;
            # a pending one is delivered (and raised) once the cleanup is done.
            blocked = {signal.SIGINT, signal.SIGTERM}
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
            try:
                leftover = _delete_namespaces([n for n in created if n in _list_namespaces()])
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            if leftover:
                log.error("namespaces left behind, delete with `ip netns delete`: %s", leftover)


_RECEIVER = """
import socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(1); print("ready", flush=True)
conn, _ = srv.accept(); total = 0; first = last = None
while True:
    chunk = conn.recv(1 << 20)
    if not chunk:
        break
    now = time.perf_counter(); first = first or now; last = now; total += len(chunk)
print(total, (last or 0) - (first or 0), flush=True)
"""
_SENDER = """
import socket, sys, time
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
block = b"\\0" * (1 << 20); end = time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < end:
    sock.sendall(block)
sock.close()
"""


def measure_throughput_bit_s(
    topology: Topology, *, src: int = 0, dst: int = 1, seconds: float = 1.0, port: int = 29411
) -> float:
    """TCP goodput from rank ``src`` to rank ``dst`` in bits per second, measured by sending
    for ``seconds`` (the receiver times first to last byte)."""
    receiver = subprocess.Popen(
        [*topology.exec_prefix(dst), sys.executable, "-c", _RECEIVER,
         topology.addresses[dst], str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert receiver.stdout is not None
        if receiver.stdout.readline().strip() != "ready":
            raise ConfigError(f"throughput receiver failed: {receiver.stderr.read()}")  # type: ignore[union-attr]
        subprocess.run(
            [*topology.exec_prefix(src), sys.executable, "-c", _SENDER,
             topology.addresses[dst], str(port), str(seconds)],
            check=True, capture_output=True, timeout=seconds + 60,
        )  # fmt: skip
        out, _ = receiver.communicate(timeout=60)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    total_bytes, elapsed_s = out.split()
    if float(elapsed_s) <= 0:
        raise ConfigError("throughput measurement received no data: the link is down")
    return float(total_bytes) * 8 / float(elapsed_s)
