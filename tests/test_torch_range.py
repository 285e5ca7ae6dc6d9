"""The oldest torch we claim (pyproject: ``torch>=2.4``) has every torch API our code calls.

Proven statically against ``tests/torch_api_2_4.json``, an inventory read from the torch 2.4.1
wheel's sources (``tests/torch_api.py`` says how to regenerate it). Two further tests keep the
check honest: the same reader, run on the installed torch, sees every name our code uses (so a
"missing" verdict is not a blind spot of the reader), and it does flag an API that 2.4 lacks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import torch_api

INVENTORY = Path(__file__).with_name("torch_api_2_4.json")


@pytest.fixture(scope="module")
def inventory() -> dict:
    return json.loads(INVENTORY.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def used() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    return torch_api.references(torch_api.python_files())


@pytest.fixture(scope="module")
def installed() -> torch_api.SourceTree:
    return torch_api.installed_tree()


def test_pyproject_floor_is_the_inventory_version(inventory: dict) -> None:
    pyproject = (torch_api.ROOT / "pyproject.toml").read_text(encoding="utf-8")
    floor = re.search(r'"torch>=([0-9.]+)"', pyproject)
    assert floor is not None, "pyproject must declare torch>=X"
    assert inventory["torch_version"].startswith(floor.group(1) + ".")


def test_every_torch_call_exists_in_the_oldest_supported_torch(
    inventory: dict, used: tuple, installed: torch_api.SourceTree
) -> None:
    chains, attributes = used
    assert len(chains) > 100  # the scan found our code
    problems = torch_api.missing(
        inventory, chains, attributes, torch_api.class_inventory(installed)
    )
    assert not problems, (
        f"torch {inventory['torch_version']} lacks (route through superneurons/compat.py or "
        "raise the floor in pyproject and README):\n  " + "\n  ".join(problems)
    )


def test_the_reader_sees_everything_we_use_in_the_installed_torch(
    used: tuple, installed: torch_api.SourceTree
) -> None:
    chains, attributes = used
    current = torch_api.inventory(installed, torch_api.modules_touched(chains))
    classes = torch_api.class_inventory(installed)
    assert not torch_api.missing(current, chains, attributes, classes), (
        f"the static reader misses names that torch {torch.__version__} has"
    )


def test_the_check_flags_apis_newer_than_the_floor(
    inventory: dict, installed: torch_api.SourceTree, tmp_path: Path
) -> None:
    classes = torch_api.class_inventory(installed)
    newer_method = sorted(
        set(classes["torch.Tensor"])
        - set(inventory["classes"]["torch.Tensor"])
        - torch_api._BUILTIN_METHODS
        - {n for n in classes["torch.Tensor"] if n.startswith("_")}
    )
    source = tmp_path / "newer.py"
    lines = [
        "import torch.distributed as dist",
        "from torch.utils.checkpoint import create_selective_checkpoint_contexts",
        "from torch.distributed._tools.mem_tracker import MemTracker",
        "dist.all_gather_single",
    ]
    if newer_method:
        lines.append(f"def f(t):\n    return t.{newer_method[0]}()")
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    chains, attributes = torch_api.references([source])
    problems = "\n".join(torch_api.missing(inventory, chains, attributes, classes))
    assert "torch.utils.checkpoint.create_selective_checkpoint_contexts" in problems
    assert "torch.distributed._tools is not in the inventory: regenerate it" in problems
    assert "torch.distributed.all_gather_single" in problems
    if newer_method:
        assert f"torch.Tensor.{newer_method[0]}" in problems


def _backward_mm_count(must_save: object) -> tuple[int, torch.Tensor]:
    """aten.mm calls in backward of a checkpointed block (recompute included), and the grad."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint

    from superneurons.compat import selective_checkpoint_contexts

    class CountMM(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            CountMM.calls += func is torch.ops.aten.mm.default
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def block(inputs: torch.Tensor) -> torch.Tensor:
        return torch.relu(inputs @ weight).sin() @ weight

    out = checkpoint(
        block,
        x,
        use_reentrant=False,
        context_fn=lambda: selective_checkpoint_contexts(must_save),  # type: ignore[arg-type]
    )
    with CountMM():
        out.sum().backward()
    return CountMM.calls, weight.grad


def test_compat_selective_checkpoint_saves_what_it_is_told_and_matches_eager() -> None:
    torch.manual_seed(0)
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    (torch.relu(x @ weight).sin() @ weight).sum().backward()
    save_mm, grad_save = _backward_mm_count(lambda op: op is torch.ops.aten.mm.default)
    save_none, grad_none = _backward_mm_count(lambda op: False)
    # The first matmul feeds the recomputed relu: recomputed only when not saved. (The second
    # one's output is needed by no backward formula: early stop never recomputes it.)
    assert save_none == save_mm + 1
    torch.testing.assert_close(grad_save, weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(grad_none, weight.grad, rtol=0, atol=0)
