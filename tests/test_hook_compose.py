"""Composed wrappers through the hook equal the old flag behaviour bit for bit (2 gloo ranks).

The reference is the hook's old flag semantics written out straightforwardly, per parameter,
outside DDP: ``warmup_steps`` steps of ``g / P`` all-reduced, then per parameter
``c = g + r; payload = encode(c); r = c - decode(payload)`` (error feedback) and the average
``decode_sum(all ranks' payloads) / P`` (gathered codecs) or ``decode(sum of encode(c / P))``
(summable codecs, residual ``c - decode(payload) · P``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed import Ranks, shared_ranks

pytestmark = pytest.mark.dist

_STEPS, _WARMUP = 5, 2
_SPECS = ["topk:ratio=0.1", "ctopk", "fft:theta=0.9,bits=8", "fp16"]


@pytest.fixture(scope="module")
def ranks() -> Ranks:
    return shared_ranks(2)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 6, 3)
        self.fc1 = nn.Linear(6 * 4 * 4, 32)
        self.out = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1))))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 2, 6, 6, generator=gen), torch.randint(0, 5, (8,), generator=gen)


def _step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()


def _reference(rank: int, world_size: int, spec: str, error_feedback: bool) -> list[torch.Tensor]:
    from superneurons.compress import Payload, parse_spec

    codec: Any = parse_spec(spec)
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    residuals: dict[str, torch.Tensor] = {}
    for step in range(_STEPS):
        _step(model, opt, rank, step)
        for name, param in model.named_parameters():
            assert param.grad is not None
            g = param.grad.reshape(-1)
            if step < _WARMUP:
                avg = g / world_size
                dist.all_reduce(avg)
            else:
                c = g + residuals[name] if error_feedback and name in residuals else g.clone()
                if codec.summable:
                    payload = codec.encode(c / world_size)
                    if error_feedback:
                        residuals[name] = c - codec.decode(payload) * world_size
                    wire = payload.data.clone()
                    dist.all_reduce(wire)
                    avg = codec.decode(Payload(wire, g.numel()))
                else:
                    payload = codec.encode(c)
                    if error_feedback:
                        residuals[name] = c - codec.decode(payload)
                    received = [torch.empty_like(payload.data) for _ in range(world_size)]
                    dist.all_gather(received, payload.data)
                    payloads = [Payload(data, g.numel()) for data in received]
                    avg = codec.decode_sum(payloads) / world_size
            param.grad.copy_(avg.view_as(param.grad))
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _hooked(rank: int, compression: Any) -> list[torch.Tensor]:
    from superneurons.compress import register_compression

    torch.manual_seed(0)
    model = DistributedDataParallel(_Net(), bucket_cap_mb=0.0001)  # several buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    register_compression(model, compression)
    for step in range(_STEPS):
        _step(model, opt, rank, step)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _compare(rank: int, world_size: int) -> list[tuple[str, bool]]:
    from superneurons.compress import ErrorFeedback, Warmup, compose, parse_spec

    out = []
    for spec in _SPECS:
        composed = ErrorFeedback(Warmup(parse_spec(spec), steps=_WARMUP))
        flags = compose(spec, error_feedback=True, warmup_steps=_WARMUP)
        plain = Warmup(parse_spec(spec), steps=_WARMUP)
        with_ef = _reference(rank, world_size, spec, error_feedback=True)
        without_ef = _reference(rank, world_size, spec, error_feedback=False)
        for label, compression, expected in [
            ("ErrorFeedback(Warmup)", composed, with_ef),
            ("compose(flags)", flags, with_ef),
            ("Warmup only", plain, without_ef),
        ]:
            got = _hooked(rank, compression)
            same = all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
            out.append((f"{spec} {label}", same))
    return out


def test_composed_wrappers_equal_the_old_flags_bitwise(ranks: Ranks) -> None:
    for results in ranks.run(_compare, timeout_s=120):
        for label, same in results:
            assert same, label
