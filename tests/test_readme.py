"""The README serves users: its Python snippets run as written (each in a fresh interpreter), it
is short and wrapped, its links resolve, and it and the examples import only public paths."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
_BLOCK = re.compile(r"(<!-- snippet-not-run[^>]*-->\s*)?```python\n(.*?)```", re.S)
MAX_LINES = 300
MAX_COLUMNS = 100


def _snippets(*, run_only: bool = True) -> list[str]:
    return [code for skip, code in _BLOCK.findall(README.read_text()) if not (skip and run_only)]


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
    """At most 300 lines, and every relative link and every file path in its layout table
    exists in the repository."""
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES
    links = re.findall(r"\]\(((?!https?:)[^)#]+)\)", text)
    layout = re.findall(
        r"`((?:memory|codecs|schemes|strategy|train|ddp|bench)/[\w/]+(?:\.py|/))`", text
    )
    assert links and layout
    missing = [p for p in links if not (ROOT / p).exists()]
    missing += [p for p in layout if "<" not in p and not (ROOT / "src/superneurons" / p).exists()]
    assert not missing, f"README points at paths that do not exist: {missing}"


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """Lines outside code blocks and tables (tables may be wider)."""
    lines, in_code = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and not line.startswith("|"):
            lines.append((number, line))
    return lines


def test_readme_prose_is_wrapped_at_100_columns() -> None:
    """Prose lines (not code, not tables) at most 100 characters: wrap, never widen."""
    text = README.read_text()
    wide = [f"{n}: {line}" for n, line in _prose_lines(text) if len(line) > MAX_COLUMNS]
    assert not wide, f"wrap these README lines at {MAX_COLUMNS} columns:\n" + "\n".join(wide)


def test_the_quickstart_is_two_commands() -> None:
    text = README.read_text()
    section = text[text.index("## Quickstart") :]
    section = section[: section.index("\n## ", 1)]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]


def _source(module: str) -> Path | None:
    """The file of a ``superneurons`` module (a package's ``__init__.py``), if it exists."""
    base = ROOT / "src" / Path(*module.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _exported(path: Path) -> set[str] | None:
    """The literal ``__all__`` of a module's source, None without one (read, not imported)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return None


def _public(module: str) -> bool:
    """``superneurons``, a package directly under it that declares ``__all__``, or one of the
    integration modules (one per framework, imported on demand)."""
    parts = module.split(".")
    path = _source(module)
    if path is None or _exported(path) is None:
        return False
    return (
        len(parts) == 1
        or (len(parts) == 2 and path.name == "__init__.py")
        or (len(parts) == 3 and parts[1] == "integrations")
    )


def _imports(code: str) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for every import in ``code``."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def _private_imports(code: str) -> list[str]:
    bad = []
    for module, names in _imports(code):
        if module.split(".")[0] != "superneurons":
            continue  # torch, transformers, ...: not ours to judge
        path = _source(module)
        if path is None or not _public(module):
            bad.append(f"{module} is not a public module")
            continue
        exported = _exported(path) or set()
        bad += [f"{module}.{name} is not in its __all__" for name in names if name not in exported]
    return bad


_SOURCES = {"README.md": lambda: "\n".join(_snippets(run_only=False))} | {
    f"examples/{path.name}": path.read_text for path in EXAMPLES
}


@pytest.mark.parametrize("source", sorted(_SOURCES))
def test_readme_and_examples_import_only_public_names(source: str) -> None:
    bad = _private_imports(_SOURCES[source]())
    assert not bad, f"{source}: import from public paths (a package's __all__):\n" + "\n".join(bad)


def test_the_public_path_rule_means_what_it_says() -> None:
    assert _private_imports("from superneurons.memory import apply_plan") == []
    assert _private_imports("from superneurons.integrations.hf import plan_for_batch") == []
    assert _private_imports("from superneurons.memory.runtime import apply_plan")
    assert _private_imports("from superneurons.train.rank import exit_rank")
    assert _private_imports("from superneurons.train import leave_process_group")
