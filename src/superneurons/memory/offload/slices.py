"""A streamed weight read in slices of rows: the LM head's weight under the vocabulary-sliced loss.

A streamed unit's weights visit the device whole around its forward and backward
(:mod:`.weights`); the LM head's ``(V, H)`` weight is the largest of a language model, and its
whole gradient comes with it in backward. Under a head plan with ``vocab_rows``
(:mod:`superneurons.memory.chunked.vocab`) the loss reads the weight one slice of rows at a
time, so :class:`StreamedRows` serves it from the weight's host copy:

* **a slice** is copied host -> device when the loss asks for it, the next slice while this
  one computes (two slices on the device at most); nothing of the weight stays on the device
  between slices;
* **a slice's gradient** ``dW_c`` (``(r, H)``, on the device) is copied into its rows of a
  host gradient buffer as soon as it is computed, so the whole ``(V, H)`` gradient exists only
  on the host. Under a plan the buffer is handed to the host optimizer's gradient buckets
  (``deliver``: :meth:`~superneurons.memory.offload.host_buckets.GradientBuckets.
  grads_on_host`), which step it from there without a copy, waiting for the last copy's
  event; autograd then gets no gradient for the weight (``AccumulateGrad`` would only re-wrap
  the host buffer, and the parameter's post-accumulate-grad hooks do not run for it). With no
  ``deliver`` the buffer is the weight's gradient for autograd to accumulate.

CUDA: the slices come from the pinned host copy on the weight stream's side stream, their
gradients go out on a stream of their own (the two directions use separate copy engines),
ordered by events and ``record_stream``; the host buffer is pinned; no
``torch.cuda.synchronize()``. CPU: the same code, copies synchronous, the host buffer made
outside every tracker (only the device copies count).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from superneurons.memory.tracker import untracked

__all__ = ["HostRowGradient", "StreamedRows"]


class StreamedRows:
    """The rows of a streamed weight (``host``: its host copy, ``(V, H)``) for the
    vocabulary-sliced loss (:class:`superneurons.memory.chunked.vocab.RowSource`).

    Args:
        host: the host copy (pinned on CUDA) the host optimizer writes.
        device: where the loss computes.
        stream: the side stream of the host -> device copies (None on CPU).
        counters: the weight stream's counters (``h2d_bytes``, ``fetches``), updated here.

    Attributes:
        deliver: takes each backward's host gradient instead of autograd (module docstring);
            None: autograd gets it.
    """

    def __init__(
        self,
        host: torch.Tensor,
        device: torch.device,
        *,
        stream: Any = None,
        counters: dict[str, int] | None = None,
    ) -> None:
        self.host, self.device = host, device
        self._cuda = device.type == "cuda"
        self._stream = stream
        self._d2h: Any = torch.cuda.Stream(device) if self._cuda else None
        self.counters = counters if counters is not None else {}
        self.last_gradient: HostRowGradient | None = None
        self.deliver: Callable[[torch.Tensor], None] | None = None

    def fetch(self, v0: int, v1: int) -> tuple[torch.Tensor, Any]:
        """Start copying rows ``v0:v1`` to the device (on the side stream on CUDA)."""
        with untracked():  # a view of the host copy: no device byte
            rows = self.host[v0:v1]
        with _on(self._stream):
            copy = torch.empty(rows.shape, dtype=rows.dtype, device=self.device)
            copy.copy_(rows, non_blocking=self._cuda)
            event = self._stream.record_event() if self._stream is not None else None
        nbytes = copy.numel() * copy.element_size()
        self.counters["h2d_bytes"] = self.counters.get("h2d_bytes", 0) + nbytes
        self.counters["fetches"] = self.counters.get("fetches", 0) + 1
        return copy, event

    def ready(self, token: tuple[torch.Tensor, Any]) -> torch.Tensor:
        """The copy, usable on the current stream."""
        copy, event = token
        if self._cuda and event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            copy.record_stream(current)  # the allocator must not reuse it before we are done
        return copy

    def gradient(self) -> HostRowGradient:
        """A host buffer for this backward's gradient (a new one each backward: the host
        optimizer's buckets may still hold the last one, e.g. summing micro-batches)."""
        self.last_gradient = HostRowGradient(self.host, self.device, self._d2h, self.deliver)
        return self.last_gradient

    def ready_event(self) -> Any:
        """The CUDA event after which the last backward's host gradient is whole (None on CPU
        or before any backward: it is whole when the loss's backward returns)."""
        return None if self.last_gradient is None else self.last_gradient.event


class HostRowGradient:
    """One backward's gradient of a streamed weight, assembled on the host slice by slice."""

    def __init__(
        self,
        like: torch.Tensor,
        device: torch.device,
        stream: Any,
        deliver: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self._cuda = device.type == "cuda"
        self._stream = stream
        self._deliver = deliver
        with untracked():
            self.buffer: torch.Tensor | None = torch.empty(
                like.shape, dtype=like.dtype, device="cpu", pin_memory=self._cuda
            )
        self.buffer_ptr = self.buffer.data_ptr()
        self.event: Any = None  # of the last copy out

    def put(self, v0: int, v1: int, grad: torch.Tensor) -> None:
        """Copy ``grad`` (rows ``v0:v1``, on the device) into the host buffer."""
        assert self.buffer is not None, "put after result()"
        with untracked():  # a view of host memory: no device byte
            rows = self.buffer[v0:v1]
        if not self._cuda:
            with untracked():
                rows.copy_(grad)
            return
        self._stream.wait_stream(torch.cuda.current_stream(grad.device))
        with torch.cuda.stream(self._stream):
            rows.copy_(grad, non_blocking=True)
            grad.record_stream(self._stream)  # not reused before the copy has read it
            self.event = self._stream.record_event()

    def result(self) -> torch.Tensor | None:
        """The buffer, given away: to ``deliver`` (then None for autograd), or to autograd with
        no reference left here, so it becomes the parameter's ``.grad`` without a copy
        (``AccumulateGrad`` steals a gradient nobody else holds, and clones one that is)."""
        buffer, self.buffer = self.buffer, None
        assert buffer is not None, "result() twice"
        if self._deliver is None:
            return buffer
        self._deliver(buffer)
        return None


def _on(stream: Any) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
