"""What every benchmark in this folder writes beside its figures: the machine, the versions, the
exact command, the load while it ran (a helper module of the benchmark scripts, not a script).

Kept here rather than imported from the library's ``bench`` package, so a script can run against
an older source tree (``PYTHONPATH=<tree>/src``) as the "before" arm of a comparison.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float]:
    """The 1, 5 and 15-minute load averages (``uptime``'s figures) at this moment."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def environment() -> dict[str, Any]:
    import numpy
    import torch

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "cpu": cpu_name(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": numpy.__version__,
        },
        "commit": commit or None,
        "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "load_average": load_average(),
    }


def arms(specs: Sequence[str]) -> dict[str, str]:
    """``--arm NAME=SRC`` values as ``{name: src}``; exits (one line, status 2) on a source tree
    without ``superneurons/``: ``PYTHONPATH`` would silently fall back on the installed tree, and
    the two arms would be the same code."""
    parsed: dict[str, str] = {}
    for spec in specs:
        name, sep, src = spec.partition("=")
        if not sep or not name or not (Path(src) / "superneurons" / "__init__.py").is_file():
            print(f"--arm {spec!r}: expected NAME=SRC, SRC a source tree holding superneurons/",
                  file=sys.stderr)  # fmt: skip
            sys.exit(2)
        parsed[name] = src
    return parsed


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write(out: Path, name: str, title: str, body: str, record: Mapping[str, Any]) -> None:
    """``out/name.json`` (the environment, then ``record``) and ``out/name.md``."""
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    (out / f"{name}.json").write_text(
        json.dumps({"environment": env, **record}, indent=2) + "\n", encoding="utf-8"
    )
    header = (
        f"# {title}\n\nCommand: `{env['command']}`  \nMachine: {env['machine']['cpu']} "
        f"({env['machine']['cpu_count']} cores), torch {env['versions']['torch']}, Python "
        f"{env['versions']['python']}, commit {env['commit']}, {env['time_utc']}, load average "
        f"at the end {env['load_average']}\n\n"
    )
    (out / f"{name}.md").write_text(header + body, encoding="utf-8")
