"""Collective callbacks compute as the rank's own thread does (bitwise resume depends on it),
and never turn a failed collective into a completed step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import Ranks, shared_ranks
from superneurons.ddp.callbacks import then_same_threads


@pytest.fixture(scope="module")
def ranks() -> Ranks:
    return shared_ranks(2)


def _products_in_callbacks(rank: int, world_size: int) -> list[bool]:
    # PowerSGD's decompression of a (10, 256) weight at rank 2: P̂ (10, 2) @ Q̂ᵀ (2, 256) written
    # into a bucket view. On gloo's worker thread this product came out different in the last
    # bit from the same product on the rank's thread (seen on a 2-core x86 box, MKL).
    gen = torch.Generator().manual_seed(0)
    p_hat = torch.randn(10, 2, generator=gen)
    qt = torch.randn(2, 256, generator=gen)
    bucket = torch.zeros(2570)
    out = bucket[:2560].view(10, 256)
    torch.mm(p_hat, qt, out=out)
    reference = out.clone()
    same = []
    for _ in range(4):
        # an all-reduce big enough to be in flight when `then` is called: the callback then
        # runs on the backend's thread, not inline
        work = dist.all_reduce(torch.ones(1_000_000), async_op=True)

        def product(_: object) -> torch.Tensor:
            torch.mm(p_hat, qt, out=out)
            return out.clone()

        same.append(torch.equal(then_same_threads(work.get_future(), product).wait(), reference))
    return same


@pytest.mark.dist
def test_callback_products_equal_the_ranks_own(ranks: Ranks) -> None:
    for same in ranks.run(_products_in_callbacks):
        assert all(same), same


def _failed() -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_exception(RuntimeError("Connection closed by peer"))  # gloo's words for a lost rank
    return fut


@pytest.mark.parametrize("collected", [False, True])
def test_a_failed_collective_raises_through_the_callback(collected: bool) -> None:
    """The callback that writes the average into the bucket never runs on a failed collective
    (alone, or among the futures a ``collect_all`` gathered); the chain raises instead."""
    ran = []
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(torch.zeros(1))
    source = torch.futures.collect_all([done, _failed()]) if collected else _failed()
    chained = then_same_threads(source, lambda _: ran.append(1))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        chained.wait()
    assert ran == []
