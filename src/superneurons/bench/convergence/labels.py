"""The convergence benchmark's codec labels, read once into what each task trains with.

A label is the grammar's ``RUN`` (:func:`superneurons.schemes.theta.parse_run`): ``dense``;
a gradient-hook spec (``fft``, ``powersgd:rank=4``, ``torch-fp16``, ``auto``), optionally with
a θ schedule over the run after ``|`` (``fft|diminishing:start=0.99,floor=0.9,drops=4,
until=0.5``: HPDC'20's diminishing θ, :class:`~superneurons.schemes.theta.RunScheduled`); an
optimizer-side spec ``adam-momentum[...]:SPEC`` / ``adam-update[...]:SPEC``
(:class:`~superneurons.optim.adam.CompressedAdamW`); ``auto`` / ``auto:link=RATE`` on Adam
tasks (:mod:`superneurons.optim.autoadam`: dense AdamW or 1-bit Adam, chosen by the cost model;
``link=`` plans for a stated link instead of the measured one); or DiLoCo,
``diloco[steps=H,...]:SPEC`` (a ``train --sync`` spec; error feedback added to a lossy wire).

A label is read once per optimizer family, as ``train --compress`` reads it: ``auto`` names the
gradient hook's :class:`~superneurons.schemes.auto.Auto` with SGD and
:class:`~superneurons.schemes.adam.AdamAuto` with Adam/AdamW, whose options differ
(``auto:observe_steps=3`` is the hook's, ``auto:link=100mbit`` Adam's). A task trains with the
label when its family reads it and the reading can run there (an optimizer-side scheme needs an
Adam task); a label neither family reads is an error.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from superneurons.errors import ConfigError
from superneurons.schemes.adam import AdamMomentum, AdamUpdate
from superneurons.schemes.compose import with_defaults
from superneurons.schemes.diloco import DiLoCo, EveryStep
from superneurons.schemes.theta import Run, parse_run

__all__ = ["Label", "read_label"]


@dataclass(frozen=True)
class Label:
    """A codec label as written (``text``, the records' ``codec``) and what it trains with on
    an SGD task (``sgd``) and on an Adam/AdamW task (``adam``); None: not run on such tasks.
    A :class:`~superneurons.schemes.anchors.TorchDense` reading is plain DDP (no hook)."""

    text: str
    sgd: Run | None
    adam: Run | None

    def on(self, optimizer: str) -> Run | None:
        """What a task with ``optimizer`` (``sgd``, ``adam``, ``adamw``) trains with, or None."""
        return self.sgd if optimizer == "sgd" else self.adam


def read_label(text: str) -> Label:
    """Read ``text`` with each optimizer family's grammar (see the module docstring).

    Raises:
        ConfigError: neither family reads it (both reasons, when they differ).
    """
    readings: dict[bool, Run] = {}
    errors: dict[bool, str] = {}
    for adam in (False, True):
        try:
            readings[adam] = _reading(text, adam=adam)
        except ConfigError as exc:  # this family does not read it; the other may
            errors[adam] = str(exc)
    if not readings:
        sgd, adam_error = errors[False], errors[True]
        if sgd == adam_error:
            raise ConfigError(sgd)
        raise ConfigError(f"{text!r}: with SGD, {sgd}; with Adam/AdamW, {adam_error}")
    on_sgd = readings.get(False)
    if isinstance(on_sgd, AdamMomentum | AdamUpdate):  # the optimizer communicates: Adam only
        on_sgd = None
    return Label(text, on_sgd, readings.get(True))


def _reading(text: str, *, adam: bool) -> Run:
    run = parse_run(text, adam=adam)
    if isinstance(run, EveryStep):
        raise ConfigError(f"{text!r} is how dense DDP synchronises: its label is 'dense'")
    if isinstance(run, DiLoCo) and run.inner is not None:  # as train --sync reads it
        return replace(run, inner=with_defaults(run.inner))
    return run
