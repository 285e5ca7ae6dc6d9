"""Which torch APIs our code calls, and which of them an older torch defines — read, not imported.

The supported range starts at an old torch we cannot install on this CPU box (its PyPI wheels are
CUDA builds that pull GBs of NVIDIA libraries), so the floor is proven statically:

* :func:`references` parses our sources (AST) and collects every ``torch.x.y`` attribute chain,
  through import aliases (``import torch.distributed as dist``, ``from torch import nn``) and
  ``from torch.x import y``; plus every ``obj.name`` whose ``name`` is a method of one of
  :data:`CLASSES` (``tensor.untyped_storage()``: the receiver's type is unknown, the name is not).
* :func:`inventory` reads a torch *source tree* (the ``.py``/``.pyi`` files of an unpacked
  wheel) and lists, per module our code touches, the names it defines: top-level definitions,
  assignments and imports (``from m import *`` resolved through ``m.__all__``), ``torch._C``
  from its stubs, torch's dynamically copied ``_VariableFunctions``; and the methods of
  :data:`CLASSES` (with their bases inside torch).

Regenerate the committed inventory (``tests/torch_api_2_4.json``) after touching a new torch
module::

    pip download --no-deps torch==2.4.1 -d /tmp/t24            # ~800 MB, once
    cd /tmp/t24 && unzip -q torch-2.4.1-*.whl 'torch/*.py' 'torch/*.pyi' && cd -
    python tests/torch_api.py /tmp/t24 --version 2.4.1 --out tests/torch_api_2_4.json
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Code whose torch calls must exist in the oldest supported torch. compat.py is the one place
# allowed to name newer APIs (behind a guarded import that falls back on older torch).
SCANNED = ("src/superneurons", "examples")
COMPAT = "src/superneurons/compat.py"

# Classes whose method names are checked wherever our code calls ``something.name``: the
# receiver's type is unknown statically, so any attribute spelled like a method of one of these
# (in the installed torch) must exist in the old one too. Each: where it is defined, then bases.
CLASSES: dict[str, tuple[tuple[str, str], ...]] = {
    "torch.Tensor": (("torch._tensor", "Tensor"), ("torch._C", "TensorBase")),
    "torch.nn.Module": (("torch.nn.modules.module", "Module"),),
    "torch.optim.Optimizer": (("torch.optim.optimizer", "Optimizer"),),
    "torch.nn.parallel.DistributedDataParallel": (
        ("torch.nn.parallel.distributed", "DistributedDataParallel"),
        ("torch.nn.modules.module", "Module"),
    ),
}


# NOTE: ``.index(...)`` on a list is not ``Tensor.index``: names that builtins also define are
# too common on other receivers to judge without types, so the method check skips them.
_BUILTIN_METHODS = {
    name for kind in (list, tuple, dict, set, str, bytes, int, float, Path) for name in dir(kind)
}

# --------------------------------------------------------------------------- our references


def python_files(root: Path = ROOT) -> Iterator[Path]:
    for folder in SCANNED:
        for path in sorted((root / folder).rglob("*.py")):
            if path.relative_to(root).as_posix() != COMPAT:
                yield path


def _aliases(tree: ast.AST) -> tuple[dict[str, str], set[str]]:
    """Local name -> dotted torch path, and the ``module.name`` pairs of ``from`` imports."""
    aliases: dict[str, str] = {}
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "torch":
                    continue
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    aliases["torch"] = "torch"
                imported.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "torch":
                continue
            for alias in node.names:
                if alias.name == "*":
                    continue
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                imported.add(f"{node.module}.{alias.name}")
    return aliases, imported


def _chain(node: ast.expr) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def references(files: Iterable[Path]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``({dotted torch chain: files}, {attribute name used on any object: files})``."""
    chains: dict[str, set[str]] = {}
    attributes: dict[str, set[str]] = {}
    for path in files:
        where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        aliases, imported = _aliases(tree)
        for dotted in imported:
            chains.setdefault(dotted, set()).add(where)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                attributes.setdefault(node.attr, set()).add(where)
                parts = _chain(node)
                if parts and parts[0] in aliases:
                    dotted = ".".join([aliases[parts[0]], *parts[1:]])
                    chains.setdefault(dotted, set()).add(where)
    return chains, attributes


def installed_is_module(dotted: str) -> bool:
    """Whether ``dotted`` names a module of the installed torch (imports its parents)."""
    try:
        return importlib.util.find_spec(dotted) is not None
    except (ImportError, AttributeError, ValueError):
        return False


# --------------------------------------------------------------------------- a torch source tree


class SourceTree:
    """Static view of an unpacked torch: module files and the names they define."""

    def __init__(self, root: Path) -> None:
        self.root = root  # the folder that holds torch/
        self._names: dict[str, set[str]] = {}
        self._trees: dict[str, ast.Module | None] = {}

    def module_file(self, dotted: str) -> Path | None:
        base = self.root.joinpath(*dotted.split("."))
        for candidate in (
            base.with_suffix(".py"),
            base / "__init__.py",
            base.with_suffix(".pyi"),
            base / "__init__.pyi",
        ):
            if candidate.is_file():
                return candidate
        return None

    def _tree(self, dotted: str) -> ast.Module | None:
        if dotted not in self._trees:
            self._trees[dotted] = self._parse(dotted)
        return self._trees[dotted]

    def _parse(self, dotted: str) -> ast.Module | None:
        path = self.module_file(dotted)
        if path is None:
            return None
        tree = ast.parse(path.read_text(encoding="utf-8"))
        stub = path.with_suffix(".pyi")  # a module with a stub beside it: read both
        if path.suffix == ".py" and stub.is_file():
            tree.body += ast.parse(stub.read_text(encoding="utf-8")).body
        return tree

    def names(self, dotted: str) -> set[str]:
        """Every name module ``dotted`` defines at import time (statically, generously)."""
        if dotted in self._names:
            return self._names[dotted]
        self._names[dotted] = set()  # cycles through star imports end here
        tree = self._tree(dotted)
        found: set[str] = set()
        if tree is not None:
            package = dotted if self.module_file(dotted) in self._package_inits(dotted) else None
            found = self._top_level(tree.body, dotted, package)
            if dotted == "torch":  # torch/__init__ copies these in a loop over dir(...)
                found |= self.names("torch._C._VariableFunctions")
            if _calls(tree, "install_config_module"):  # makes the module a ConfigModule
                found |= self.class_members("torch.utils._config_module", "ConfigModule")
        self._names[dotted] = found
        return found

    def _package_inits(self, dotted: str) -> set[Path | None]:
        base = self.root.joinpath(*dotted.split("."))
        return {base / "__init__.py", base / "__init__.pyi"}

    def exported(self, dotted: str) -> set[str]:
        """What ``from dotted import *`` binds: ``__all__`` when static, else public names."""
        tree = self._tree(dotted)
        if tree is not None:
            declared = _static_all(tree)
            if declared is not None:
                return declared
        return {n for n in self.names(dotted) if not n.startswith("_")}

    def _resolve(self, module: str | None, level: int, here: str, package: str | None) -> str:
        if level == 0:
            return module or ""
        base = (package or here.rsplit(".", 1)[0]).split(".")
        base = base[: len(base) - (level - 1)]
        return ".".join([*base, module] if module else base)

    def _top_level(self, body: list[ast.stmt], here: str, package: str | None) -> set[str]:
        found: set[str] = set()
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    found |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    found.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                source = self._resolve(node.module, node.level, here, package)
                for alias in node.names:
                    if alias.name == "*":
                        found |= self.exported(source)
                    else:
                        found.add(alias.asname or alias.name)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For)):
                nested = [*node.body, *getattr(node, "orelse", [])]
                nested += getattr(node, "finalbody", [])
                for handler in getattr(node, "handlers", []):
                    nested += handler.body
                found |= self._top_level(nested, here, package)
        return found

    def class_members(self, dotted: str, name: str) -> set[str]:
        tree = self._tree(dotted)
        members: set[str] = set()
        for node in tree.body if tree is not None else []:
            if isinstance(node, ast.ClassDef) and node.name == name:
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        members.add(item.name)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                        members |= {t.id for t in targets if isinstance(t, ast.Name)}
        return members


def _calls(tree: ast.Module, function: str) -> bool:
    return any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == function
        for node in ast.walk(tree)
    )


def _static_all(tree: ast.Module) -> set[str] | None:
    declared: set[str] | None = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            try:
                declared = set(ast.literal_eval(node.value))
            except ValueError:
                return None
        elif (
            isinstance(node, ast.AugAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "__all__"
            and declared is not None
        ):
            try:
                declared |= set(ast.literal_eval(node.value))
            except ValueError:
                return None
    return declared


def modules_touched(chains: Iterable[str], is_module: object = installed_is_module) -> set[str]:
    """Every prefix of every chain that is a module of the installed torch."""
    touched: set[str] = set()
    for chain in chains:
        parts = chain.split(".")
        for end in range(1, len(parts) + 1):
            prefix = ".".join(parts[:end])
            if is_module(prefix):  # type: ignore[operator]
                touched.add(prefix)
    return touched


def class_inventory(tree: SourceTree) -> dict[str, list[str]]:
    """The methods and class attributes of :data:`CLASSES` in ``tree``."""
    return {
        qualified: sorted(set().union(*(tree.class_members(m, c) for m, c in where)))
        for qualified, where in CLASSES.items()
    }


def installed_tree() -> SourceTree:
    import torch

    return SourceTree(Path(torch.__file__).resolve().parents[1])


def inventory(tree: SourceTree, modules: Iterable[str]) -> dict[str, object]:
    """Names per touched module, and class members (dunders left out: never judged)."""
    present = {m: sorted(tree.names(m)) for m in sorted(modules) if tree.module_file(m)}
    classes = {
        qualified: [n for n in members if not n.startswith("__")]
        for qualified, members in class_inventory(tree).items()
    }
    return {
        "modules": present,
        "missing_modules": sorted(m for m in modules if m not in present),
        "classes": classes,
    }


# --------------------------------------------------------------------------- the check


def missing(
    inv: dict,
    chains: dict[str, set[str]],
    attributes: dict[str, set[str]],
    installed_classes: dict[str, list[str]],
) -> list[str]:
    """One line per reference the inventory's torch lacks (or cannot judge).

    Method names are compared between two *static* reads (the installed torch's and the
    inventory's), so what the reader cannot see (C-only attributes) is judged alike on both.
    """
    problems: list[str] = []
    modules, absent = inv["modules"], set(inv["missing_modules"])
    for chain, files in sorted(chains.items()):
        parts = chain.split(".")
        where = ", ".join(sorted(files))
        for end in range(1, len(parts) + 1):
            prefix = ".".join(parts[:end])
            if prefix in modules:
                continue
            if prefix in absent:
                problems.append(f"module {prefix} (used as {chain} in {where})")
            elif installed_is_module(prefix):
                problems.append(f"module {prefix} is not in the inventory: regenerate it")
            elif parts[end - 1] not in modules[".".join(parts[: end - 1])]:
                problems.append(f"{prefix} (in {where})")
            break
    problems = sorted(set(problems))
    for qualified, members in inv["classes"].items():
        newer = set(installed_classes.get(qualified, ())) - set(members) - _BUILTIN_METHODS
        newer = {name for name in newer if not name.startswith("__")}
        for name in sorted(newer & attributes.keys()):
            problems.append(
                f"{qualified}.{name} (called on something in {sorted(attributes[name])})"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the torch API inventory our code needs")
    parser.add_argument("source", type=Path, help="folder holding an unpacked torch/ tree")
    parser.add_argument("--version", required=True, help="that torch's version, e.g. 2.4.1")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    chains, _ = references(python_files())
    inv = inventory(SourceTree(args.source), modules_touched(chains))
    record = {
        "torch_version": args.version,
        "generated_by": "python tests/torch_api.py SOURCE --version V --out PATH",
        **inv,
    }
    args.out.write_text(json.dumps(record, indent=0, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{args.out}: {len(inv['modules'])} modules, missing {inv['missing_modules']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
