"""Instance-level ``forward`` patches and their exact undo: the one mechanism the runtime, the
chunked LM head and the sequence split use to run a module differently until removed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["ForwardPatches"]


class ForwardPatches:
    """Patches of ``module.forward`` on instances; :meth:`remove` restores each module exactly
    (its own instance-level forward if it had one, else the class's), last patch first, and is
    idempotent."""

    def __init__(self) -> None:
        self._restore: list[tuple[nn.Module, bool, Any]] = []

    def patch(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        """Make ``module`` call ``forward`` until :meth:`remove`."""
        had_own = "forward" in module.__dict__
        self._restore.append((module, had_own, module.__dict__.get("forward")))
        module.forward = forward  # type: ignore[method-assign]

    def remove(self) -> None:
        for module, had_own, original in reversed(self._restore):
            if had_own:
                module.forward = original  # type: ignore[method-assign]
            else:
                del module.forward
        self._restore.clear()
