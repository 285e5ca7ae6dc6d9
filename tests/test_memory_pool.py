"""TensorPool: no tensor is lost or altered, accounting returns to zero, no growth over many
steps, LRU eviction only beyond ``cache_bytes``, the slab grows by doubling and is reused."""

from __future__ import annotations

import contextlib
import gc
import logging
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory.offload.pool import PoolConfig, TensorPool
from superneurons.memory.offload.slab import alias_storage
from superneurons.memory.plan import Plan, UnitDecision
from superneurons.memory.runtime.apply import apply_plan


class _Probe(torch.autograd.Function):
    """Saves ``probe`` for backward and checks there that it came back bit for bit."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, probe: torch.Tensor, check: Callable) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(probe)
        ctx.check = check
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        (probe,) = ctx.saved_tensors
        ctx.check(probe)
        return grad, None, None


def _pool(**kw: int | bool) -> TensorPool:
    return TensorPool(PoolConfig(**kw), device=torch.device("cpu"))  # type: ignore[arg-type]


LAYOUTS = {
    "contiguous": lambda: torch.randn(6, 5),
    "transposed": lambda: torch.randn(6, 5).t(),
    "channels_last": lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    "offset_view": lambda: torch.randn(10, 7)[3:8],
    "float16": lambda: torch.randn(33).half(),
    "int64": lambda: torch.randint(0, 1 << 40, (17,)),
    "bool": lambda: torch.rand(64) > 0.5,
    "scalar": lambda: torch.tensor(3.25),
    # a strided view (k of a fused qkv projection): its whole storage travels, strides kept
    "split_view": lambda: torch.randn(2, 5, 12)[..., 4:8].unflatten(-1, (2, 2)).transpose(1, 2),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_is_exact_with_strides(layout: str) -> None:
    pool = _pool(min_offload_bytes=0)
    probe = LAYOUTS[layout]()
    expected = probe.clone()
    stride = probe.stride()
    storage_bytes = probe.untyped_storage().nbytes()  # a view that does not fill it: all of it
    seen: list[torch.Tensor] = []

    def check(back: torch.Tensor) -> None:
        assert back.dtype == expected.dtype and back.shape == expected.shape
        assert back.stride() == stride
        assert torch.equal(back, expected)
        seen.append(back)

    x = torch.randn(3, requires_grad=True)
    with pool.offloading():
        y = _Probe.apply(x, probe, check)
    assert pool.stats().host_bytes == storage_bytes
    assert pool.stats().device_bytes == 0  # evicted at once (cache_bytes=0)
    del probe  # else the pool would hand the still-live original back (no copy)
    y.sum().backward()
    assert len(seen) == 1 and pool.stats().h2d_count == 1
    del y
    stats = pool.stats()
    assert (stats.host_bytes, stats.device_bytes, stats.live_slots) == (0, 0, 0)
    assert stats.d2h_count == 1


def test_views_of_one_storage_share_one_copy_each_way() -> None:
    # x and x.view(-1, C) saved by two nodes of one unit (a LayerNorm and a Linear): the planner
    # counts the storage once, so the pool copies it once out and once back
    pool = _pool(min_offload_bytes=0)
    base = torch.randn(2, 4, 3)
    views = [base, base.view(-1, 3), base[1:, 1:]]
    expected = [v.clone() for v in views]
    seen: list[torch.Tensor] = []
    x = torch.randn(3, requires_grad=True)
    with pool.offloading():
        y = x
        for view in views:
            y = _Probe.apply(y, view, seen.append)
    assert pool.stats().host_bytes == base.numel() * base.element_size()
    del base, views, view
    y.sum().backward()
    stats = pool.stats()
    assert (stats.d2h_count, stats.h2d_count) == (1, 1)
    assert len(seen) == 3
    for back, want in zip(reversed(seen), expected, strict=True):
        assert back.shape == want.shape and back.stride() == want.stride()
        assert torch.equal(back, want)
    assert len({t.untyped_storage().data_ptr() for t in seen}) == 1
    del y, seen
    assert (pool.stats().host_bytes, pool.stats().live_slots) == (0, 0)


@pytest.mark.parametrize("order", ["small_first", "large_first"])
def test_a_small_view_then_a_larger_one_share_one_copy(order: str) -> None:
    # a slice saved before the whole tensor (or a larger slice) of the same storage: the slot
    # holds the storage, so one copy out and one back whatever the order
    pool = _pool(min_offload_bytes=0)
    base = torch.randn(6, 5)
    views = [base[4:, 1:], base[1:], base]
    views = views if order == "small_first" else views[::-1]
    expected = [(v.clone(), v.stride()) for v in views]
    seen: list[torch.Tensor] = []
    x = torch.randn(3, requires_grad=True)
    with pool.offloading():
        y = x
        for view in views:
            y = _Probe.apply(y, view, seen.append)
    assert pool.stats().host_bytes == base.untyped_storage().nbytes()
    del base, views, view
    y.sum().backward()
    assert (pool.stats().d2h_count, pool.stats().h2d_count) == (1, 1)
    for back, (want, stride) in zip(reversed(seen), expected, strict=True):
        assert back.stride() == stride  # the view comes back as it was saved
        assert torch.equal(back, want)
    del y, seen
    assert (pool.stats().host_bytes, pool.stats().live_slots) == (0, 0)


def test_parameters_buffers_and_small_tensors_stay_on_device() -> None:
    layer = nn.Linear(64, 64)
    pool = TensorPool(
        PoolConfig(min_offload_bytes=1024),
        device=torch.device("cpu"),
        excluded=lambda: [*layer.parameters()],
    )
    big, small = torch.randn(32, 64), torch.randn(2, 64)  # 8 KiB and 512 B
    with pool.offloading():
        out_big = layer(
            big.requires_grad_()
        )  # saves big (offloaded) and the weight (a parameter: kept)
        out_small = layer(
            small.requires_grad_()
        )  # saves small (below the threshold: kept) and the weight
    stats = pool.stats()
    assert stats.d2h_count == 1 and stats.host_bytes == big.numel() * 4
    assert stats.kept_small == 3
    (out_big.sum() + out_small.sum()).backward()


def test_lru_cache_evicts_only_beyond_cache_bytes() -> None:
    nbytes = 4096 * 4
    pool = _pool(min_offload_bytes=0, cache_bytes=2 * nbytes)
    x = torch.randn(4096, requires_grad=True)
    with pool.offloading():
        h = x
        for _ in range(5):
            h = h.sin()  # each sin saves its input: 5 saved tensors of nbytes
    stats = pool.stats()
    assert stats.d2h_count == 3  # the three oldest evicted, the two newest cached
    assert stats.device_bytes == 2 * nbytes and stats.host_bytes == 3 * nbytes
    h.sum().backward()
    stats = pool.stats()
    assert stats.cache_hits == 2  # backward starts with the newest: served from the cache
    assert stats.d2h_bytes >= stats.h2d_bytes  # nothing fetched that was not sent
    del h
    assert (pool.stats().host_bytes, pool.stats().device_bytes) == (0, 0)
    ref = x.detach().clone().requires_grad_()
    r = ref
    for _ in range(5):
        r = r.sin()
    r.sum().backward()
    assert torch.equal(x.grad, ref.grad)


def test_slab_grows_by_doubling_with_a_log_then_is_one_buffer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = _pool(min_offload_bytes=0, host_bytes=1024)
    x = torch.randn(1 << 16, requires_grad=True)  # 256 KiB per saved tensor

    def step() -> None:
        with pool.offloading():
            y = x.sin().sin().sin()
        y.sum().backward()

    with caplog.at_level(logging.INFO, logger="superneurons.memory"):
        step()
    assert any("growing" in r.message for r in caplog.records)
    capacity = pool.stats().slab_capacity_bytes
    assert capacity >= pool.stats().peak_host_bytes
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="superneurons.memory"):
        for _ in range(3):
            step()
    assert not any("growing" in r.message for r in caplog.records)  # sized between steps
    assert pool.stats().slab_capacity_bytes == capacity


def test_200_steps_accounting_returns_to_zero_without_growth() -> None:
    model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)))
    plan = Plan(
        units=tuple(UnitDecision(str(i), "offload") for i in range(4)),
        strategy="offload",
        budget_bytes=1 << 30,
    )
    x = torch.randn(16, 32)
    with apply_plan(model, plan, pool_config=PoolConfig(min_offload_bytes=0)) as handle:
        pool = handle.pool
        counts: list[int] = []
        for step in range(200):
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            stats = pool.stats()
            assert (stats.host_bytes, stats.device_bytes, stats.live_slots) == (0, 0, 0), step
            assert not pool._groups and not pool._cache and not pool._dedupe
            if step in (20, 199):
                gc.collect()
                counts.append(len(gc.get_objects()))
                capacity = stats.slab_capacity_bytes
        stats = pool.stats()
        assert stats.slab_capacity_bytes == capacity
        # one copy per storage and step: the input and each Tanh output (which the next unit's
        # Linear saves too: the two units share its slot, as the planner counts storages)
        assert stats.d2h_count == 200 * 5
        assert stats.prefetch_hits + stats.demand_fetches + stats.cache_hits >= stats.h2d_count
    assert counts[1] - counts[0] < 100, counts  # no objects pile up step after step


def test_state_dict_round_trip_and_config_validation() -> None:
    pool = _pool(min_offload_bytes=0)
    x = torch.randn(256, requires_grad=True)
    with pool.offloading():
        y = x.exp()
    y.sum().backward()
    other = _pool()
    other.load_state_dict(pool.state_dict())
    assert other.stats() == pool.stats().__class__(
        **{**pool.stats().__dict__, "slab_capacity_bytes": other.stats().slab_capacity_bytes}
    )
    with pytest.raises(ConfigError, match="cache_bytes"):
        PoolConfig(cache_bytes=-1)
    with pytest.raises(ConfigError, match="nested"), pool.offloading(), pool.offloading():
        pass


@pytest.mark.cuda
def test_cuda_pinned_slab_side_streams_equal_eager() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4))).cuda()
    ref = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4))).cuda()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(512, 256, device="cuda")
    plan = Plan(
        units=tuple(UnitDecision(str(i), "offload") for i in range(4)),
        strategy="offload",
        budget_bytes=1 << 34,
    )
    ref(x).square().mean().backward()
    with apply_plan(model, plan, pool_config=PoolConfig(min_offload_bytes=0)) as handle:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
        assert handle.pool.host_buffers()[0].is_pinned()
        stats = handle.pool.stats()
        assert stats.prefetch_hits > 0 and stats.host_bytes == 0
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_prefetch_takes_the_previous_group_only_when_adjacent() -> None:
    x = torch.randn(1024, requires_grad=True)
    for previous, expected in ((False, 1), (True, 2)):
        pool = _pool(min_offload_bytes=0)
        with pool.offloading() as first:
            a = x.sin()  # saves x: one slot in the first group
        with pool.offloading() as second:
            b = a.sin()  # saves a: one slot in the second group
        pool.backward_entered(second, previous=previous)
        stats = pool.stats()  # a and x are still alive: served as the originals, no copy
        assert stats.h2d_count + stats.still_resident == expected
        assert first == second - 1
        b.sum().backward()
        del a, b
        assert (pool.stats().host_bytes, pool.stats().device_bytes) == (0, 0)


@pytest.mark.parametrize("fake", [False, True])
def test_alias_of_a_resident_storage_dies_with_its_last_user(fake: bool) -> None:
    # a prefetch of a tensor still resident elsewhere re-wraps its storage (``set_``); under
    # fake tensors the dispatch cache kept that storage alive for good (memory.sizing.simulate then
    # measured one activation too many)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() if fake else contextlib.nullcontext():
        t = torch.arange(12.0).view(3, 4)
        storage = t.untyped_storage()
        alias = alias_storage(
            storage, 4, torch.Size([2, 4]), (4, 1), dtype=t.dtype, device=t.device
        )
        assert alias.untyped_storage()._cdata == storage._cdata and alias.storage_offset() == 4
        if not fake:
            assert torch.equal(alias, t[1:])
        gone = weakref.ref(storage)
        del t, storage, alias
        gc.collect()
        assert gone() is None
