"""The demo's link: shaped namespaces while the arms train, nothing left behind afterwards (also
after an exception and after Ctrl-C, with ranks running inside), loopback where no link can be
made (the reason kept for the report's first line)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from superneurons.bench.links import netns
from superneurons.demo import link as demo_link_module
from superneurons.demo.link import demo_link
from superneurons.errors import ConfigError
from tiny_data import write_fashion_mnist

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="needs root with ip and tc (network namespaces)",
)


def _namespaces_of(pid: int) -> set[str]:
    return {name for name in netns._list_namespaces() if name.startswith(f"sn-{pid}-")}


def _host_links() -> set[str]:
    """Devices in this (the host's) namespace named as the demo names its own."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    names = {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}
    return {n for n in names if n.startswith(("snv", "snh", "snbr"))}


def test_without_namespaces_the_demo_runs_on_loopback_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse() -> None:
        raise ConfigError("creating network namespaces needs root: run as root")

    monkeypatch.setattr(demo_link_module, "check_prerequisites", refuse)
    with demo_link(10_000_000, 2) as link:
        assert not link.shaped and link.topology is None
        assert link.loopback_reason == "creating network namespaces needs root"
        assert link.describe().startswith("loopback")
    with demo_link(10_000_000, 2, shaping=False) as link:
        assert link.loopback_reason == "--no-shaping"
    with pytest.raises(ConfigError, match="below 8kbit"), demo_link(10, 2):
        pass


@pytest.mark.netns
@needs_root
def test_the_link_is_shaped_then_removed_also_after_an_exception() -> None:
    pid = os.getpid()
    before = _namespaces_of(pid)
    with pytest.raises(RuntimeError, match="boom"), demo_link(10_000_000, 2) as link:
        assert link.shaped and link.topology is not None
        assert set(link.topology.namespaces) <= _namespaces_of(pid) - before
        qdisc = subprocess.run(
            [*link.topology.exec_prefix(0), "tc", "qdisc", "show", "dev", link.topology.interfaces[0]],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert "tbf" in qdisc and "10Mbit" in qdisc
        # NOTE: tbf shapes TCP goodput to 86-97% of its rate (bench/links/netns.py)
        assert link.measured_bit_s is not None and 5e6 < link.measured_bit_s < 10.5e6
        raise RuntimeError("boom")
    assert _namespaces_of(pid) == before
    assert not _host_links()


@pytest.mark.netns
@needs_root
def test_ctrl_c_leaves_no_bridge_of_three_ranks() -> None:
    """Three ranks meet on a bridge in a hub namespace: Ctrl-C removes it with the rest."""
    script = (
        "import os, signal\n"
        "from superneurons.demo.link import demo_link\n"
        "with demo_link(10_000_000, 3, measure=False) as link:\n"
        "    print(' '.join([*link.topology.namespaces, link.topology.hub]), flush=True)\n"
        "    signal.pause()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    assert child.stdout is not None
    names = child.stdout.readline().split()
    assert len(names) == 4 and set(names) <= _namespaces_of(child.pid)
    os.killpg(child.pid, signal.SIGINT)
    assert child.wait(timeout=60) != 0
    assert not _namespaces_of(child.pid) and not _host_links()


_CHILD = """
import json, sys
from dataclasses import replace
from pathlib import Path
from superneurons.demo.link import demo_link
from superneurons.demo.race import launch_arm
from superneurons.train.config import TrainConfig
config = TrainConfig(**json.loads(sys.argv[1]))
with demo_link(10_000_000, {nproc}, measure=False) as link:
    print(" ".join(link.topology.namespaces), flush=True)
    launch_arm(config, link, nproc={nproc}, name="dense")
"""


@pytest.mark.slow
@pytest.mark.netns
@needs_root
def test_ctrl_c_while_ranks_train_leaves_no_namespace_or_qdisc(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the demo's whole process group, as a terminal sends it) while the
    ranks train inside the namespaces: the ranks end, and every namespace (with its veth pair
    and qdiscs) is deleted."""
    nproc = 2
    data = tmp_path / "data"
    write_fashion_mnist(data, n_train=256, n_test=32)
    config = {
        "model": "mlp", "data": "fashion-mnist", "data_dir": str(data), "batch_size": 16,
        "out_dir": str(tmp_path / "run"), "epochs": 1000, "time_budget_s": 600.0,
        "eval_every_s": 600.0, "backend": "gloo",
    }  # fmt: skip
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(nproc=nproc), json.dumps(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        names = child.stdout.readline().split()
        assert len(names) == nproc and set(names) <= _namespaces_of(child.pid)
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text()) and time.monotonic() < deadline:
            assert child.poll() is None, child.stderr.read() if child.stderr else ""
            time.sleep(0.5)
        assert metrics.read_text(), "the ranks never started training"
        os.killpg(child.pid, signal.SIGINT)
        child.wait(timeout=120)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    assert child.returncode != 0
    assert not _namespaces_of(child.pid)
    assert not _host_links()
    ranks = subprocess.run(
        ["pgrep", "-f", str(tmp_path / "run" / "config.json")], capture_output=True, check=False
    )
    assert ranks.returncode == 1, "ranks still running"
