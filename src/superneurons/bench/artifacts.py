"""Benchmark artifacts: every benchmark writes a JSON file (records + the machine, library
versions and exact command that produced them), a Markdown table and a PNG.

matplotlib is an optional extra (``pip install superneurons[bench]``); it is imported only when
a plot is drawn, with the non-interactive Agg backend.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["environment", "markdown_table", "pyplot", "write_json", "write_markdown"]


def environment() -> dict[str, Any]:
    """Machine, versions and command line, for reproducibility."""
    import torch

    cpu_model = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "cpu": cpu_model,
            "cpu_count": os.cpu_count(),
            "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "superneurons": _own_version(),
        },
        "torch_threads": torch.get_num_threads(),
    }


def _own_version() -> str:
    from superneurons.version import __version__

    return __version__


def write_json(path: Path, records: Sequence[Mapping[str, Any]], **extra: Any) -> Path:
    """Write ``{"environment": ..., **extra, "records": records}`` to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"environment": environment(), **extra, "records": list(records)}
    path.write_text(json.dumps(body, indent=2, default=_json_default) + "\n", encoding="utf-8")
    return path


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def markdown_table(
    records: Sequence[Mapping[str, Any]], columns: Sequence[str], *, floatfmt: str = ".4g"
) -> str:
    """A GitHub-flavoured Markdown table of ``columns`` from ``records``."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return format(value, floatfmt)
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in records]
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, title: str, body: str) -> Path:
    """Write a Markdown report that names the environment it was measured on."""
    env = environment()
    header = (
        f"# {title}\n\n"
        f"Command: `{env['command']}`  \n"
        f"Machine: {env['machine']['cpu']} ({env['machine']['cpu_count']} cores), "
        f"torch {env['versions']['torch']}, Python {env['versions']['python']}, "
        f"{env['time_utc']}\n\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + body, encoding="utf-8")
    return path


def pyplot() -> Any:
    """matplotlib.pyplot with the Agg backend, or a clear error naming the extra to install."""
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        from superneurons.errors import ConfigError

        raise ConfigError("plots need matplotlib: pip install 'superneurons[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
