"""Memory: profile a training step, plan keep/offload/recompute under a byte budget, run the plan.

SuperNeurons (Wang et al., PPoPP'18): liveness analysis, unified tensor pool, cost-aware
recomputation, in eager PyTorch. The verbs: ``profile_step`` -> ``make_plan`` -> ``apply_plan``.
"""

from __future__ import annotations

from superneurons.memory.below import below_profiles
from superneurons.memory.bounds import largest_unit_bytes, resident_bytes, working_sets
from superneurons.memory.cost import DEVICE_PRESETS, CostModel, cost_model, measure_copy_bandwidth
from superneurons.memory.headloss import linear_cross_entropy
from superneurons.memory.host_optimizer import HostOptimizer, HostOptimizerView
from superneurons.memory.optim_backward import register_optimizer_in_backward
from superneurons.memory.optim_host import HostOptimizerState, HostStateStats
from superneurons.memory.plan import (
    ACTIONS,
    PLAN_VERSION,
    STRATEGIES,
    HeadChunking,
    InfeasibleBudgetError,
    Plan,
    SeqChunking,
    TensorDecision,
    UnitDecision,
)
from superneurons.memory.planner import make_plan, min_peak_bytes
from superneurons.memory.pool import PoolConfig, PoolStats, TensorPool
from superneurons.memory.profile import profile_step
from superneurons.memory.profile_types import Profile, SavedTensor, UnitProfile, default_units
from superneurons.memory.runtime import PlanHandle, apply_plan
from superneurons.memory.simulate import profile_zoo, simulate_plan
from superneurons.memory.tracker import LiveStorageTracker

__all__ = [
    # profiling
    "LiveStorageTracker",
    "Profile",
    "SavedTensor",
    "UnitProfile",
    "default_units",
    "profile_step",
    "profile_zoo",
    "simulate_plan",
    # bounds and the device cost model
    "DEVICE_PRESETS",
    "cost_model",
    "largest_unit_bytes",
    "measure_copy_bandwidth",
    "resident_bytes",
    "working_sets",
    # planning
    "ACTIONS",
    "PLAN_VERSION",
    "STRATEGIES",
    "CostModel",
    "InfeasibleBudgetError",
    "Plan",
    "TensorDecision",
    "UnitDecision",
    "make_plan",
    "min_peak_bytes",
    # below the largest layer: the LM head + loss in chunks, MLPs over the sequence
    "HeadChunking",
    "SeqChunking",
    "below_profiles",
    "linear_cross_entropy",
    # running a plan
    "HostOptimizer",
    "HostOptimizerState",
    "HostOptimizerView",
    "HostStateStats",
    "PlanHandle",
    "PoolConfig",
    "PoolStats",
    "TensorPool",
    "apply_plan",
    "register_optimizer_in_backward",
]
