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


def test_readme_is_short_and_its_links_resolve() -> None:
    """The README serves users: at most 300 lines, and every relative link and every file path
    in its layout table exists in the repository."""
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    root = README.parent
    links = re.findall(r"\]\(((?!https?:)[^)#]+)\)", text)
    layout = re.findall(r"`((?:memory|codecs|strategy|train|ddp)/[\w/]+(?:\.py|/))`", text)
    assert links and layout
    missing = [p for p in links if not (root / p).exists()]
    missing += [p for p in layout if "<" not in p and not (root / "src/superneurons" / p).exists()]
    assert not missing, f"README points at paths that do not exist: {missing}"
