"""The house rules the code keeps: functions read (none over 100 lines), folders hold one feature,
imports flow one way, no import cycles, the planner is pure, no printing inside the library.

Read from the source with ``ast``; nothing is imported, so this runs in well under a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "superneurons"

# Layers, lowest first. A module may import its own layer or any lower one, never a higher one.
# A module's layer is that of the longest dotted prefix below (relative to ``superneurons``):
# commands -> demo -> bench -> train/integrations -> compress (the public re-exports) ->
# ddp/optim (process groups) -> strategy (pure decisions) -> schemes (the grammar and what it
# names) -> codecs (pure: config -> bytes) -> codecs.coding -> models/data -> leaf modules.
LAYERS: dict[str, float] = {
    "errors": 0,
    "bytesize": 0,
    "rates": 0,
    "durations": 0,
    "compat": 0,
    "device": 0,
    "version": 0,
    "randomness": 0,
    "models": 1,
    "data": 1,
    # memory/: the shared data at its top (Plan, Profile and its units, the autograd nodes, the
    # live-storage tracker, FSDP2), then a folder per feature, the pure planner lowest; the
    # package's re-exports sit above all of them.
    "memory": 2,
    "memory.planner": 2.1,  # pure: Profile + budget -> Plan
    "memory.offload": 2.2,  # where bytes leave the device: the host pool, the host optimizer
    "memory.chunked": 2.3,  # the LM head + loss and block MLPs in chunks
    "memory.runtime": 2.4,  # apply_plan: hooks on the user's model
    "memory.profiling": 2.5,  # one step of the user's model -> Profile
    "memory.sizing": 2.6,  # fake tensors from configs: plan --model hf:, the max-* searches
    "memory.__init__": 2.9,
    "codecs.coding": 2,
    "codecs": 3,
    "schemes": 4,
    "strategy": 5,
    "ddp": 6,
    "optim": 6,
    "localsgd": 6,  # DiLoCo's outer loop and the outer gradient's transport (process groups)
    "replicas": 6,  # the cross-rank consistency check (a collective)
    "compress": 7,  # the public import path: re-exports of codecs, spec, ddp and optim
    "train": 8,
    "integrations": 8,
    "bench": 9,
    "demo": 10,
    "commands": 11,
    "cli": 11,
    "__main__": 11,
    "__init__": 12,  # the package's re-exports sit above everything they re-export
}
# Folders hold at most this many modules, ``__init__`` counted: a folder per feature.
MAX_MODULES = 15
# Folders over it, each with the reason it is not split yet.
FOLDER_ALLOWANCE: dict[str, str] = {}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _layer(module: str) -> float:
    parts = module.split(".")[1:]
    if not parts:
        return LAYERS["__init__"]
    if _is_package(module) and ".".join([*parts, "__init__"]) in LAYERS:
        return LAYERS[".".join([*parts, "__init__"])]  # a package's re-exports, above its folders
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in LAYERS:
            return LAYERS[prefix]
    raise AssertionError(
        f"{module}: its top-level name {parts[0]!r} has no layer; add it to LAYERS in "
        "tests/test_house.py"
    )


def _imports(module: str, path: Path) -> set[str]:
    """Every superneurons module ``module`` imports, at module level or inside functions."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("superneurons"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if not target.startswith("superneurons"):
                continue
            for alias in node.names:  # `from pkg import submodule` depends on the submodule
                candidate = f"{target}.{alias.name}"
                found.add(candidate if candidate in MODULES else target)
    found.discard(module)
    return {name for name in found if name in MODULES}


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


# No function over this many lines (its ``def`` to its last line, docstring included): split by
# concept, never by size.
MAX_FUNCTION_LINES = 100
# Functions over it, each with the reason ("module:function": why).
FUNCTION_ALLOWANCE: dict[str, str] = {}


def _long_functions() -> dict[str, int]:
    found = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found[f"{module}:{node.name}"] = lines
    return found


def test_functions_read() -> None:
    long = _long_functions()
    over = [
        f"{name} ({lines} lines)" for name, lines in long.items() if name not in FUNCTION_ALLOWANCE
    ]
    assert not over, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them by concept, or say in "
        f"FUNCTION_ALLOWANCE why not yet): {over}"
    )
    stale = sorted(set(FUNCTION_ALLOWANCE) - set(long))
    assert not stale, f"FUNCTION_ALLOWANCE names functions that read now: remove {stale}"


def test_folders_hold_one_feature_each() -> None:
    crowded = []
    for folder in sorted({path.parent for path in MODULES.values()}):
        name = folder.relative_to(SRC.parent).as_posix()
        count = sum(1 for _ in folder.glob("*.py"))
        if count > MAX_MODULES and name not in FOLDER_ALLOWANCE:
            crowded.append(f"{name}: {count} modules")
    assert not crowded, f"folders over {MAX_MODULES} modules (split by feature): {crowded}"


def test_imports_flow_one_way() -> None:
    upward = [
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
        for module, targets in GRAPH.items()
        for target in sorted(targets)
        if _layer(target) > _layer(module)
    ]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


# What the pure planner may reach, directly or through what it imports: its own folder, the
# shared data it reads and writes (Profile in, Plan out) and the leaf modules. No runtime, no
# offload execution, no autograd Function, no tracker or process group.
PLANNER = "superneurons.memory.planner"
# (param_state: what a parameter holds beside its data, read by profile_types.unit_params)
PLANNER_READS = {
    "superneurons.memory.plan",
    "superneurons.memory.profile_types",
    "superneurons.memory.param_state",
}


def test_the_planner_is_pure() -> None:
    reached: set[str] = set()
    todo = [m for m in GRAPH if m.startswith(PLANNER)]
    while todo:
        module = todo.pop()
        for target in GRAPH[module] - reached:
            reached.add(target)
            todo.append(target)
    outside = sorted(
        m
        for m in reached
        if not m.startswith(PLANNER) and m not in PLANNER_READS and _layer(m) != LAYERS["errors"]
    )
    assert not outside, f"the planner reaches beyond its data: {outside}"
    functions = [
        f"{module}:{node.name}"
        for module, path in MODULES.items()
        if module.startswith(PLANNER)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef)
        and any(ast.unparse(base).endswith("Function") for base in node.bases)
    ]
    assert not functions, f"autograd Functions in the planner: {functions}"


def test_no_import_cycles() -> None:
    # Package __init__ files re-export their submodules; a submodule importing a sibling through
    # its package is not a cycle of concepts, so packages are left out of the walk.
    graph = {
        m: {t for t in ts if not _is_package(t)} for m, ts in GRAPH.items() if not _is_package(m)
    }
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def test_library_never_prints() -> None:
    printing = []
    for module, path in MODULES.items():
        if _layer(module) >= LAYERS["commands"] and module != "superneurons":
            continue  # the CLI is the one place that prints
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "print"
            ):
                printing.append(f"{module}:{node.lineno}")
    assert not printing, "print() inside the library (log instead): " + ", ".join(printing)
