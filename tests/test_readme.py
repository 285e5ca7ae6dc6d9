"""The README's Python snippets run as written (each in a fresh interpreter)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"(<!-- snippet-not-run[^>]*-->\s*)?```python\n(.*?)```", re.S)


def _snippets() -> list[str]:
    return [code for skip, code in _BLOCK.findall(README.read_text()) if not skip]


def test_readme_has_snippets() -> None:
    assert len(_snippets()) >= 3


@pytest.mark.parametrize("index", range(len(_snippets())))
def test_readme_snippet_runs(index: int, tmp_path: Path) -> None:
    code = "import torch; torch.set_num_threads(1)\n" + _snippets()[index]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
