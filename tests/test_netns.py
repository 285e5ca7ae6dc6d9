"""The namespace harness creates shaped links and always deletes what it created."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from superneurons.bench.links import netns
from superneurons.errors import ConfigError
from superneurons.rates import parse_rate

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="needs root with ip and tc (network namespaces)",
)


def _ours() -> set[str]:
    return {name for name in netns._list_namespaces() if name.startswith(f"sn-{os.getpid()}-")}


def test_links_are_shaped_to_8kbit_or_more() -> None:
    assert netns.check_shaping_rate(parse_rate("100mbit")) == 100_000_000
    for slow in ("100", "1bit", "7kbit"):
        with pytest.raises(ConfigError, match="below 8kbit"):
            netns.check_shaping_rate(parse_rate(slow))


def test_bad_nproc_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="nproc"), netns.network_namespaces(1):
        pass


@pytest.mark.netns
@needs_root
def test_two_ranks_linked_shaped_and_removed() -> None:
    before = _ours()
    with netns.network_namespaces(2, rate_bit_s=parse_rate("100mbit")) as topo:
        assert set(topo.namespaces) <= _ours() - before
        assert topo.hub is None
        ping = subprocess.run(
            [*topo.exec_prefix(0), "ping", "-c", "1", "-W", "2", topo.addresses[1]],
            capture_output=True,
            check=False,
        )
        qdisc = subprocess.run(
            [*topo.exec_prefix(1), "tc", "qdisc", "show", "dev", topo.interfaces[1]],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        if shutil.which("ping"):
            assert ping.returncode == 0, ping.stderr
        assert "tbf" in qdisc and "100Mbit" in qdisc
    assert _ours() == before


@pytest.mark.netns
@needs_root
def test_namespaces_removed_when_body_raises() -> None:
    before = _ours()
    with pytest.raises(RuntimeError, match="boom"), netns.network_namespaces(3) as topo:
        assert topo.hub is not None and len(_ours() - before) == 4  # 3 ranks + the bridge
        raise RuntimeError("boom")
    assert _ours() == before


@pytest.mark.netns
@needs_root
@pytest.mark.parametrize(("sig", "exit_code"), [(signal.SIGTERM, 128 + 15), (signal.SIGINT, 130)])
def test_namespaces_removed_on_signal(sig: signal.Signals, exit_code: int) -> None:
    """SIGTERM or Ctrl-C in the body still runs the cleanup, then ends the process."""
    script = (
        "import os, signal, sys\n"
        "from superneurons.bench.links.netns import network_namespaces\n"
        "try:\n"
        "    with network_namespaces(2) as topo:\n"
        "        print(' '.join(topo.namespaces), flush=True)\n"
        f"        os.kill(os.getpid(), {int(sig)})\n"
        "        signal.pause()\n"
        "except KeyboardInterrupt:\n"
        "    sys.exit(130)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    names = proc.stdout.split()
    assert proc.returncode == exit_code, proc.stderr
    assert len(names) == 2
    assert not set(names) & set(netns._list_namespaces())


@pytest.mark.netns
@needs_root
def test_stale_namespaces_of_dead_runs_are_cleaned() -> None:
    dead_pid = 2**22 + 12345  # above the default pid_max: never a live process
    stale = f"sn-{dead_pid}-0-r0"
    other = "snx-keep-me"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    subprocess.run(["ip", "netns", "add", other], check=True)
    try:
        removed = netns.cleanup_stale_namespaces()
        assert stale in removed
        remaining = netns._list_namespaces()
        assert stale not in remaining and other in remaining
    finally:
        subprocess.run(["ip", "netns", "delete", other], check=False)
        subprocess.run(["ip", "netns", "delete", stale], check=False, capture_output=True)
