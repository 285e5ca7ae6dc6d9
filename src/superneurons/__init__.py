"""superneurons: train networks that do not fit device memory, and train data-parallel over
networks too slow for plain all-reduce.

Two halves, one library:

* memory (SuperNeurons, Wang et al., PPoPP'18): profile a step, plan keep/offload/recompute
  under a byte budget, execute the plan in eager PyTorch;
* communication (Wang et al., HPDC'20): FFT gradient sparsification with range-based floats
  and the baselines it claims to beat, as DDP comm hooks.

Importing this package touches no CUDA and starts nothing.
"""

from __future__ import annotations

import logging

from superneurons.bytesize import format_bytes, parse_bytes
from superneurons.compress import (
    Codec,
    CompressionState,
    DeferredCompression,
    ErrorFeedback,
    Payload,
    parse_spec,
    register_compression,
)
from superneurons.errors import ConfigError
from superneurons.memory import (
    InfeasibleBudgetError,
    Plan,
    Profile,
    apply_plan,
    make_plan,
    profile_step,
)
from superneurons.train import exit_rank
from superneurons.version import __version__

logging.getLogger("superneurons").addHandler(logging.NullHandler())

__all__ = [
    # memory: profile -> plan -> run (SuperNeurons, PPoPP'18)
    "InfeasibleBudgetError",
    "Plan",
    "Profile",
    "apply_plan",
    "make_plan",
    "profile_step",
    # communication: codecs as DDP comm hooks (FFT compression, HPDC'20)
    "Codec",
    "CompressionState",
    "DeferredCompression",
    "ErrorFeedback",
    "Payload",
    "parse_spec",
    "register_compression",
    "exit_rank",  # how a process that used a process group ends (superneurons.train)
    # common
    "ConfigError",
    "__version__",
    "format_bytes",
    "parse_bytes",
]
