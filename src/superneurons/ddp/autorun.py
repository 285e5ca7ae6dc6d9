"""The hook's side of ``auto``: observe, decide on rank 0, broadcast, apply, re-decide on drift.

:class:`AutoController` carries out :func:`superneurons.strategy.select` (the seam in
docs/CONTRACTS.md):

1. at registration (collective): fit the network's α-β lines on the real process group;
2. steps ``1 .. observe_steps`` run dense; each bucket's ready time is taken when the hook is
   called for it, relative to the end of the forward pass (a forward hook marks t0; step 0 is
   not timed because DDP rebuilds its buckets after it). ``time.perf_counter`` on CPU, CUDA
   events on GPUs (read one step later, never synchronised);
3. at bucket 0 of the next step rank 0 measures the candidate codecs on a real gradient of the
   largest bucket, calls ``select`` and broadcasts the :class:`Assignment` JSON (length, then
   bytes); every rank applies it: per parameter, a route for
   :func:`~superneurons.ddp.reduce.reduce_bucket`;
4. every ``drift_steps`` steps the ranks agree (all-reduce MAX) whether the measured exposed
   step time left ``predicted_step_s`` by more than ``drift`` on each of the last
   ``drift_steps`` steps; if so every rank re-measures the network and observes again.

Every collective above is issued at a step number and bucket index that are the same on every
rank, so the ranks stay in lock step; only rank 0's timings enter a decision.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from superneurons.ddp.bucket import Route
from superneurons.errors import ConfigError
from superneurons.schemes.auto import Auto

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from superneurons.strategy import Assignment, CodecCost, DecisionInputs, NetworkModel

__all__ = ["AutoController"]

logger = logging.getLogger("superneurons.compress")

_STATE_VERSION = 1
# Elements of the real gradient the candidates are timed on: 16 MB, because per-byte costs
# measured on 4 MB under-predicted top-k's encode of a 100 MB bucket (predicted 0.48 s, measured
# 2.9 s per step: benchmarks/results/network/auto/2026-11-22-1820-cpu2-random-data).
_SAMPLE_NUMEL = 2**22


class CompressionState(Protocol):
    """What the controller reads of the hook's state (``hookstate.CompressionState``)."""

    step: int
    rank: int
    world_size: int
    process_group: dist.ProcessGroup | None
    names_by_param: dict[int, str]


class _Clock:
    """Seconds between marks: ``perf_counter`` on CPU, CUDA events (read later) on GPUs."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float | None:
        """``end - start`` in seconds, or None while a CUDA event has not completed."""
        if self.cuda:
            if not (start.query() and end.query()):
                return None
            return float(start.elapsed_time(end)) / 1e3
        return float(end - start)


class AutoController:
    """Carries an :class:`Assignment` out; ``state_dict`` holds the decision (see module docs)."""

    def __init__(self, config: Auto, *, error_feedback: bool) -> None:
        self.config = config
        self.error_feedback = error_feedback
        self.network: NetworkModel | None = None
        self.assignment: Assignment | None = None
        self.decisions = 0
        self._observe_from = 0  # first step of the current observation
        self._decided_step = -1
        self._clock: _Clock | None = None
        self._t0: Any = None
        # (step, bucket key, names, numel, t0 mark, ready mark)
        self._ready: list[tuple[int, str, tuple[str, ...], int, Any, Any]] = []
        self._ends: list[tuple[int, Any, Any]] = []  # (step, t0 mark, averaged mark)
        self._sample: torch.Tensor | None = None
        self._drifting = 0
        # what rank 0 measured for its last decision: ``strategy.decide_at`` replays it at
        # another world size or link rate (None on the other ranks and after a resume)
        self.inputs: DecisionInputs | None = None

    # -- registration -------------------------------------------------------------------
    def attach(self, ddp_model: DistributedDataParallel, state: CompressionState) -> None:
        """Measure the network (collective) and mark t0 after every training forward."""
        from superneurons.strategy import measure_network

        device = next((p.device for p in ddp_model.parameters()), torch.device("cpu"))
        self._clock = _Clock(device)
        self.network = measure_network(state.process_group, device=device)
        logger.info("auto: network %s", self.network.to_dict())

        def forward_done(module: torch.nn.Module, _inputs: Any, _output: Any) -> None:
            if module.training and torch.is_grad_enabled() and self._clock is not None:
                self._t0 = self._clock.mark()

        ddp_model.module.register_forward_hook(forward_done)

    # -- per bucket ---------------------------------------------------------------------
    @property
    def decide_step(self) -> int:
        """The step whose bucket 0 decides (the observation skips step 0: bucket rebuild)."""
        skip = 1 if self._observe_from == 0 else 0
        return self._observe_from + skip + self.config.observe_steps

    def routes(self, state: CompressionState, bucket: dist.GradBucket) -> list[Route]:
        """This bucket's route per parameter (collectives at bucket 0 on decision steps)."""
        from superneurons.strategy import bucket_key

        names = tuple(state.names_by_param[id(p)] for p in bucket.parameters())
        if bucket.index() == 0:
            self._at_step_start(state, bucket)
        if self.assignment is None:
            if state.step >= max(self._observe_from, 1) and self._clock is not None:
                numel = bucket.buffer().numel()
                mark = self._clock.mark()
                self._ready.append((state.step, bucket_key(names), names, numel, self._t0, mark))
                if self._sample is None or self._sample.numel() < min(numel, _SAMPLE_NUMEL):
                    self._sample = _sample_of(bucket)
            return [None] * len(names)
        return [self.assignment.params.get(name) for name in names]  # None: dense

    def after_reduce(
        self,
        state: CompressionState,
        bucket: dist.GradBucket,
        fut: torch.futures.Future[torch.Tensor],
    ) -> torch.futures.Future[torch.Tensor]:
        """Record when each bucket's average is ready; the step's exposed end is the latest.

        NOTE: every bucket, not only the last one: gloo runs collectives on several threads, so
        the last-launched (often small) bucket can finish while a big one is still on the wire
        (at 100 Mbit/s the last bucket's stamp came ~10 s before the step's end).
        """
        clock, step, t0 = self._clock, state.step, self._t0
        if clock is None or t0 is None:
            return fut

        def stamp(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            self._ends.append((step, t0, clock.mark()))
            return done.value()

        return fut.then(stamp)

    # -- decisions ----------------------------------------------------------------------
    def _at_step_start(self, state: CompressionState, bucket: dist.GradBucket) -> None:
        step = state.step
        device = bucket.buffer().device
        if self.assignment is None and step == self.decide_step:
            self._decide(state, device)
        elif self.assignment is not None:
            self._track_drift(step - 1)
            since = step - self._decided_step
            if since > 0 and since % self.config.drift_steps == 0:
                flag = torch.tensor([self._drifting], dtype=torch.int64, device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=state.process_group)
                if int(flag.item()) >= self.config.drift_steps:
                    self._redecide(state, device, step)

    def _redecide(self, state: CompressionState, device: torch.device, step: int) -> None:
        from superneurons.strategy import measure_network

        logger.info("auto: step time drifted from the prediction; observing again")
        self.network = measure_network(state.process_group, device=device)
        self.assignment = None
        self._observe_from = step
        self._ready, self._ends, self._sample, self._drifting = [], [], None, 0

    def _decide(self, state: CompressionState, device: torch.device) -> None:
        text = self._select(state.world_size, state.step).to_json() if state.rank == 0 else ""
        length = torch.tensor([len(text.encode())], dtype=torch.int64, device=device)
        dist.broadcast(length, src=_global_rank0(state), group=state.process_group)
        raw = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
        if state.rank == 0:
            raw.copy_(torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8))
        dist.broadcast(raw, src=_global_rank0(state), group=state.process_group)
        from superneurons.strategy import Assignment

        self.apply(Assignment.from_json(bytes(raw.cpu().tolist()).decode()), step=state.step)

    def apply(self, assignment: Assignment, *, step: int) -> None:
        """Use ``assignment`` from ``step`` on (local: call it identically on every rank)."""
        self.assignment = assignment
        self._decided_step = step
        self._drifting = 0
        self._ready, self._ends, self._sample = [], [], None
        self.decisions += 1
        logger.info("auto: %s", assignment.reason)

    def _outside_s(self, step: int) -> float:
        """Median seconds per observed step outside backward and its communication: from the
        last bucket's average to the next step's forward end (optimizer, data, forward).

        The prediction counts from backward's start, the bench times whole steps; without this
        the ResNet's qsgd route read as predicted 0.519 s, measured 0.769 s
        (benchmarks/results/network/auto/2026-11-23-0000-cpu2-random-data).
        """
        if self._clock is None:
            return 0.0
        t0_by_step = {s: t0 for s, _key, _names, _numel, t0, _mark in self._ready}
        t0_by_step[step] = self._t0  # this step's forward has ended: its bucket 0 is here
        outside: list[float] = []
        first = max(self._observe_from, 1)  # step 0 ends in DDP's bucket rebuild
        for s, end in self._step_ends().items():
            t0_next = t0_by_step.get(s + 1)
            if s < first or t0_next is None:
                continue
            seconds = self._clock.seconds(end, t0_next)
            if seconds is not None:
                outside.append(max(seconds, 0.0))
        return statistics.median(outside) if outside else 0.0

    def _step_ends(self) -> dict[int, Any]:
        """Per observed step, the mark of its latest bucket average (see :meth:`after_reduce`)."""
        assert self._clock is not None
        latest: dict[int, tuple[float, Any]] = {}
        for s, t0, mark in self._ends:
            span = self._clock.seconds(t0, mark)
            if span is not None and (s not in latest or span > latest[s][0]):
                latest[s] = (span, mark)
        return {s: mark for s, (_span, mark) in latest.items()}

    def _select(self, world_size: int, step: int) -> Assignment:
        from superneurons.strategy import (
            DEFAULT_CANDIDATES,
            BucketTiming,
            DecisionInputs,
            measure_codecs,
        )

        if self.network is None or self._clock is None or self._sample is None:
            raise ConfigError("auto: nothing observed; run at least one training step")
        ready: dict[str, list[float]] = {}
        params: dict[str, tuple[tuple[str, ...], int]] = {}
        backward: dict[int, float] = {}
        for observed, key, names, numel, t0, mark in self._ready:
            seconds = self._clock.seconds(t0, mark) if t0 is not None else None
            if seconds is None:
                continue
            ready.setdefault(key, []).append(max(seconds, 0.0))
            params[key] = (names, numel)
            backward[observed] = max(backward.get(observed, 0.0), seconds)
        buckets = [
            BucketTiming(key, params[key][0], params[key][1], statistics.median(times))
            for key, times in ready.items()
        ]
        costs = measure_codecs(DEFAULT_CANDIDATES, self._sample, world_size=world_size)
        if self.error_feedback:  # what the hook does per step beyond the encode (see reduce)
            costs = [_with_feedback(cost) for cost in costs]
        self.inputs = DecisionInputs(
            buckets=tuple(buckets),
            costs=tuple(costs),
            backward_s=statistics.median(backward.values()),
            outside_s=self._outside_s(step),
            network=self.network,
            max_rel_error=self.config.max_rel_error,
            max_rel_error_lowrank=self.config.max_rel_error_lowrank,
        )
        return self.inputs.decide()

    def _track_drift(self, step: int) -> None:
        """Compare the last finished step's exposed time with the prediction."""
        if self.assignment is None or self._clock is None or not self._ends:
            return
        ends = [(t0, mark) for s, t0, mark in self._ends if s == step]
        self._ends = []
        spans = [self._clock.seconds(t0, mark) for t0, mark in ends]
        known = [span for span in spans if span is not None]
        if not known:
            return
        measured = max(known)  # the latest bucket's average ends the step
        predicted = self.assignment.predicted_step_s
        off = abs(measured - predicted) / max(predicted, 1e-9)
        self._drifting = self._drifting + 1 if off > self.config.drift else 0

    # -- checkpoint ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "assignment": self.assignment.to_json() if self.assignment is not None else None,
            "network": self.network.to_dict() if self.network is not None else None,
            "decided_step": self._decided_step,
            "observe_from": self._observe_from,
            "decisions": self.decisions,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from superneurons.strategy import Assignment, NetworkModel

        if state.get("version") != _STATE_VERSION:
            raise ConfigError(f"auto state version {state.get('version')!r} is not supported")
        if state["network"] is not None:
            self.network = NetworkModel.from_dict(state["network"])
        self._observe_from = int(state["observe_from"])
        self.assignment = None
        if state["assignment"] is not None:
            self.apply(Assignment.from_json(state["assignment"]), step=int(state["decided_step"]))
        self.decisions = int(state["decisions"])


def _with_feedback(cost: CodecCost) -> CodecCost:
    """``cost`` as the hook pays it with error feedback: gathered codecs, PowerSGD and the
    two-phase quantisers add the residual in and compute the new one before the collective's
    result is needed (measured as ``feedback_s_per_byte``); cast routes and dense carry none
    under auto (see :func:`~superneurons.ddp.reduce.reduce_bucket`)."""
    import dataclasses

    if cost.codec is None or (cost.summable and not cost.low_rank and not cost.two_phase):
        return cost
    return dataclasses.replace(
        cost, encode_s_per_byte=cost.encode_s_per_byte + cost.feedback_s_per_byte
    )


def _sample_of(bucket: dist.GradBucket) -> torch.Tensor:
    """The candidates' timing sample: the bucket's largest gradient in its matrix shape
    (PowerSGD's products depend on it), cut to its first rows to hold at most
    ``_SAMPLE_NUMEL`` elements; flat when the largest gradient is 1-D."""
    grads = bucket.gradients()
    largest = max(grads, key=lambda g: g.numel())
    if largest.dim() < 2:
        return bucket.buffer()[:_SAMPLE_NUMEL].detach().float().clone()
    matrix = largest.detach().reshape(largest.shape[0], -1)
    rows = max(1, min(matrix.shape[0], _SAMPLE_NUMEL // matrix.shape[1]))
    return matrix[:rows].float().clone()


def _global_rank0(state: CompressionState) -> int:
    """The global rank of the group's rank 0 (``broadcast`` takes a global rank)."""
    group = state.process_group
    if group is None:
        return 0
    return int(dist.get_global_rank(group, 0))
