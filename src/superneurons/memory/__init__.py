"""Memory: profile a training step, plan keep/offload/recompute under a byte budget, run the plan.

SuperNeurons (Wang et al., PPoPP'18): liveness analysis, unified tensor pool, cost-aware
recomputation, in eager PyTorch. The verbs: ``profile_step`` -> ``make_plan`` -> ``apply_plan``.
"""

from __future__ import annotations

from superneurons.memory.chunked.headloss import linear_cross_entropy
from superneurons.memory.offload.host_optimizer import HostOptimizer, HostOptimizerView
from superneurons.memory.offload.optim_backward import register_optimizer_in_backward
from superneurons.memory.offload.optim_host import HostOptimizerState, HostStateStats
from superneurons.memory.offload.pool import PoolConfig, PoolStats, TensorPool
from superneurons.memory.plan import (
    ACTIONS,
    PLAN_VERSION,
    STRATEGIES,
    HeadChunking,
    InfeasibleBudgetError,
    Plan,
    SeqChunking,
    TensorDecision,
    TrainingStep,
    UnitDecision,
)
from superneurons.memory.planner.bounds import largest_unit_bytes, resident_bytes, working_sets
from superneurons.memory.planner.cost import (
    DEVICE_PRESETS,
    CostModel,
    cost_model,
    measure_copy_bandwidth,
)
from superneurons.memory.planner.decide import make_plan, min_peak_bytes
from superneurons.memory.profile_types import Profile, SavedTensor, UnitProfile, default_units
from superneurons.memory.profiling.below import below_profiles
from superneurons.memory.profiling.step import profile_step
from superneurons.memory.runtime.apply import PlanHandle, apply_plan
from superneurons.memory.sizing.simulate import profile_zoo, simulate_plan
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
    "TrainingStep",
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
