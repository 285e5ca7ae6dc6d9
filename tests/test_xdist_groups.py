"""The README's test command runs pytest-xdist with ``--dist loadgroup``: the tests of one
``xdist_group`` (the network-namespace tests; the tests that share one two-rank launch) must run
on one worker. pytest-xdist tags their ids for that, and some pytest releases ignore the tag
(pytest 9.2: pytest-xdist#1386) — the groups then silently run on both workers at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

GROUPED = """
import os
from pathlib import Path

import pytest


@pytest.mark.xdist_group("one")
@pytest.mark.parametrize("i", range(4))
def test_grouped(i):
    Path(os.environ["WORKERS_OUT"], f"{__name__}-{i}").write_text(os.environ["PYTEST_XDIST_WORKER"])
"""


def test_the_tests_of_one_group_run_on_one_worker(tmp_path: Path) -> None:
    for name in ("test_a.py", "test_b.py"):
        (tmp_path / name).write_text(GROUPED)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # this folder is the rootdir
    out = tmp_path / "workers"
    out.mkdir()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-p",
            "no:cacheprovider",
        ],
        cwd=tmp_path,
        env=dict(os.environ, WORKERS_OUT=str(out)),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:]
    workers = {path.name: path.read_text() for path in out.iterdir()}
    assert len(workers) == 8, workers
    assert len(set(workers.values())) == 1, (
        f"one group ran on several workers {workers}: this pytest-xdist does not group on "
        "this pytest (pytest-xdist#1386); install pytest<9.2 (pyproject.toml's dev extra)"
    )
