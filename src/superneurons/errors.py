"""Exception types of superneurons.

Every error a user can cause (a bad spec string, a budget below the minimum, a config mismatch
across ranks, a file that cannot be read) is a :class:`ConfigError` whose message says what to
do; the CLI prints it as one line instead of a traceback.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "ConfigError", "DataError", "ReplicaMismatchError"]


class ConfigError(ValueError):
    """Bad user input: the message names the problem and the fix."""


class DataError(ConfigError):
    """A dataset file or directory that is missing, truncated or corrupt; the message names
    the file and how to replace it."""


class CheckpointError(ConfigError):
    """A training checkpoint that is missing, unreadable or from another run; the message
    names the file and what to do (resume from another one, or start over)."""


class ReplicaMismatchError(ConfigError):
    """Data-parallel ranks hold different parameters or optimizer state when training starts;
    the message names the first tensor that differs and the two ranks."""
