"""A plan under ``torch.compile``: refused by default, traced on request.

A plan's budget is a promise about the eager step the profile saw. ``torch.compile`` runs
another step: inductor fuses kernels and allocates its own buffers below the dispatcher, and the
min-cut partitioner of AOTAutograd decides what the compiled forward saves for backward, so the
profile does not describe the compiled step. Measured on the tiny Llama of
``benchmarks/compile_budget.py`` (CPU, AdamW, c10 allocator view,
``benchmarks/results/compile/``): in fp32 a recompute plan at the reported minimum ran 16% over
its budget compiled (+1,033,856 B, close to the logits' size; autocast and bf16 fitted), while
the same plan run eagerly meets its prediction to within 1%. So a compiled call of a planned model
is refused by default, with a :class:`~superneurons.errors.ConfigError` that says what to do.

``apply_plan(model, plan, compile="trace")`` opts in: the runtime's hooks then trace without a
graph break of their own (no ``_cdata``, no dynamo-skipped call, no logging in traced code:
``tests/test_memory_compile.py``) and recompute units become the checkpoint dynamo traces
(:mod:`superneurons.memory.runtime.recompute`); the budget is then measured, not promised (``bench
memory``'s CPU meter sees inductor's allocations).

NOTE: a ``raise`` inside traced code does not reach the caller: dynamo gives up on the frame
and runs it again eagerly, where ``torch.compiler.is_compiling()`` is False, so the compiled
call would silently run the eager plan (measured on torch 2.13). The refusal is therefore a
function wrapped in ``torch.compiler.disable``: dynamo breaks the graph before it and runs it
eagerly, where it raises. Under ``fullgraph=True`` that graph break is dynamo's own error,
whose text carries the same message as the disabled function's reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from superneurons.compat import compiler_disabled
from superneurons.errors import ConfigError

if TYPE_CHECKING:
    from superneurons.memory.plan import Plan

__all__ = [
    "COMPILE_MODES",
    "CompileGuard",
    "CompileMode",
    "guard_compiled_calls",
    "refusal_message",
]

CompileMode = Literal["refuse", "trace"]
COMPILE_MODES: tuple[str, ...] = ("refuse", "trace")


def refusal_message(where: str | None = None) -> str:
    """The refusal's text for a compiled call that reached ``where`` (a unit fqn or "model")."""
    at = f" (at {where!r})" if where is not None else ""
    return (
        f"torch.compile reached a model running a memory plan{at}: the plan's budget holds for "
        "the eager step it was profiled from, not for the compiled one (inductor decides what a "
        "compiled step saves and allocates). Run the planned model eagerly; or compile the "
        "model without a plan and bound its activations with "
        "torch._functorch.config.activation_memory_budget; or apply the plan with "
        "apply_plan(..., compile='trace') and measure the compiled step's peak yourself "
        "(superneurons bench memory)"
    )


def _refuse(where: str) -> None:
    raise ConfigError(refusal_message(where))


class CompileGuard:
    """Called by the pre-hooks of :func:`guard_compiled_calls`: under ``"refuse"`` it refuses
    a compiled call; outside ``torch.compile`` a call costs one ``is_compiling()``.

    NOTE: ``torch.compiler.disable`` imports ``torch._dynamo`` (seconds, once per process) when
    the plan is applied; a non-reentrant checkpoint, i.e. any recompute unit, imports it anyway.
    """

    def __init__(self, mode: str) -> None:
        if mode not in COMPILE_MODES:
            raise ConfigError(f"compile must be one of {COMPILE_MODES}, got {mode!r}")
        self.mode = mode
        self._refuse: Callable[[str], None] | None = None
        if mode == "refuse":
            # made here, eagerly: dynamo must meet an already disabled function in traced code
            self._refuse = compiler_disabled(_refuse, reason=refusal_message())

    def __call__(self, where: str) -> None:
        if self._refuse is not None and torch.compiler.is_compiling():
            self._refuse(where)


def guard_compiled_calls(model: nn.Module, plan: Plan, *, mode: str) -> list[Any]:
    """Under ``"refuse"``, forward pre-hooks (run before any other) on ``model`` and on every
    unit of ``plan`` (a unit may be compiled alone: ``unit.compile()``) that refuse a compiled
    call; none under ``"trace"``. Returns the removable handles."""
    guard = CompileGuard(mode)
    if mode == "trace":
        return []
    where = {"model": model} | {unit.fqn: model.get_submodule(unit.fqn) for unit in plan.units}
    return [
        module.register_forward_pre_hook(lambda _m, _a, w=name: guard(w), prepend=True)
        for name, module in where.items()
    ]
