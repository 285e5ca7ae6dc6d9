"""profile_step: liveness timeline vs dispatch-level and MemTracker measurements (real and fake)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory.profiling.step import Profile, profile_step
from superneurons.memory.tracker import LiveStorageTracker


class _Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in-place relu, dropout, residual add: the awkward cases for liveness
        return x + self.drop(torch.relu_(self.bn(self.conv(x))))


class _Branchy(nn.Module):
    """Branches, a shared module called twice, in-place ops, dropout, BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(_Block(8), _Block(8))
        self.shared = _Block(8)
        self.side = nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        x = self.shared(self.shared(x)) + self.side(x)
        return self.head(x.flatten(1))


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    model = _Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))


def _memtracker_peak(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> int:
    # NOTE: MemTracker is new in torch 2.5; the supported floor is 2.4 (pyproject).
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    model, opt = copy.deepcopy((model, opt))
    tracker = mem_tracker.MemTracker()
    tracker.track_external(model, opt, x, y)
    with tracker:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


@pytest.mark.parametrize("fake", [False, True])
def test_predicted_peak_matches_memtracker(fake: bool) -> None:
    model, opt, x, y = _setup()
    profile = profile_step(model, x, y, nn.functional.cross_entropy, opt, fake=fake)
    measured = _memtracker_peak(model, opt, x, y)
    predicted = profile.predicted_peak_bytes(steady_state=False)
    assert abs(predicted - measured) <= 0.03 * measured
    assert abs(profile.measured_peak_bytes - measured) <= 0.005 * measured


def test_tracker_matches_memtracker_in_steady_state() -> None:
    model, opt, x, y = _setup()
    model(x).sum().backward()
    opt.step()  # momentum buffers now exist
    opt.zero_grad(set_to_none=True)
    tracker = LiveStorageTracker()
    tracker.register([*model.parameters(), *model.buffers(), x, y])
    tracker.register([b for s in opt.state.values() for b in s.values() if torch.is_tensor(b)])
    with tracker:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    measured = _memtracker_peak(model, opt, x, y)
    assert abs(tracker.peak_bytes - measured) <= 0.005 * measured


def test_profile_leaves_model_and_optimizer_unchanged() -> None:
    model, opt, x, y = _setup()
    before = copy.deepcopy(model.state_dict())
    profile = profile_step(model, x, y, nn.functional.cross_entropy, opt)
    assert not opt.state and all(p.grad is None for p in model.parameters())
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0)
    assert profile.optimizer_state_bytes == profile.param_bytes - sum(
        b.numel() * b.element_size() for b in model.buffers()
    )


def profile_fwd(profile: Profile, fqn: str) -> int:
    return next(u.fwd_start_event for u in profile.units if u.fqn == fqn)


def test_saved_tensors_keys_units_and_dedup() -> None:
    model, opt, x, y = _setup()
    profile = profile_step(model, x, y, nn.functional.cross_entropy, opt, fake=True)
    keys = [s.key for s in profile.saved]
    assert len(keys) == len(set(keys))
    assert any(k.startswith("shared.conv#1:") for k in keys)  # second call of the shared module
    # the blocks, and the rest of the step's path to them (stem, shared block, side, head)
    units = ["stem", "blocks.0", "blocks.1", "shared", "side", "head"]
    assert sorted(u.fqn for u in profile.units) == sorted(units)
    assert [u.fqn for u in profile.units] == sorted(units, key=lambda f: profile_fwd(profile, f))
    by_storage: dict[int, int] = {}
    for s in profile.saved:
        by_storage[s.storage] = by_storage.get(s.storage, 0) + s.nbytes
    assert all(by_storage[i] == life.nbytes for i, life in enumerate(profile.storages))
    for unit in profile.units:
        assert unit.fwd_start_event <= unit.fwd_end_event < profile.forward_end_event
        assert unit.bwd_start_event > profile.forward_end_event
        if not unit.fqn.startswith("blocks."):
            continue
        assert unit.flops == 2 * (8 * 8 * 9) * (4 * 16 * 16)  # one 3x3 conv: 2 FLOPs per MAC


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h[h > 0].sum().expand(1)  # boolean mask: data-dependent shape


def test_fake_failure_is_config_error() -> None:
    model = _DataDependent()
    x = torch.randn(2, 4)
    with pytest.raises(ConfigError, match="fake=False"):
        profile_step(model, x, None, lambda out, _: out.sum(), fake=True)
    assert profile_step(model, x, None, lambda out, _: out.sum(), fake=False).num_events > 0
