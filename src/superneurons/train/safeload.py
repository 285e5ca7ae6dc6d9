"""Reading a state file without running code: ``torch.load(weights_only=True)`` everywhere.

A pickle can import and call anything, so a checkpoint folder someone else wrote could run code
when it is resumed from. PyTorch's weights-only unpickler (the default of ``torch.load`` since
torch 2.6, and an option on every torch we support) rebuilds tensors, dicts, lists, tuples,
numbers, strings and a fixed set of torch types, and refuses every other import before it
happens. What superneurons saves stays inside that set (PyTorch's PowerSGD hook state holds a
numpy ``RandomState``: it is stored as tensors, :mod:`superneurons.ddp.torch_hooks`).
:func:`refusal` turns the unpickler's refusal into one line that says what the file would have
imported.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

__all__ = ["load_weights_only", "refusal"]

# What the refusal names: "Unsupported global: GLOBAL numpy.random._pickle.__randomstate_ctor
# was not an allowed global by default" (torch 2.4 to 2.13), "Trying to load unsupported GLOBAL
# os.makedirs whose module os is blocked" (torch 2.13, modules it never allows).
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_REFUSED = ("Weights only load failed", "WeightsUnpickler error")
# What an older superneurons wrote that the weights-only loader refuses.
_OLDER = {
    "numpy.random": "an older superneurons pickled PyTorch's PowerSGD hook state "
    "(--compress torch-powersgd) with a numpy RandomState",
}


def load_weights_only(path: str | Path, *, mmap: bool = False) -> Any:
    """``torch.load`` of ``path`` onto the CPU that rebuilds only tensors and plain data."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def refusal(exc: BaseException) -> str | None:
    """Why the weights-only loader refused a file, in one line; None when ``exc`` is another
    failure (truncated, not a zip archive, ...)."""
    text = str(exc)
    if not any(marker in text for marker in _REFUSED):
        return None
    found = _GLOBAL.search(text)
    if found is None:
        return "refused: it holds more than tensors and plain data (not loaded, nothing run)"
    name = found.group(1)
    older = next((why for prefix, why in _OLDER.items() if name.startswith(prefix)), None)
    what = f"refused: loading it would import {name} (not loaded, nothing run)"
    return f"{what}; {older}" if older else what
