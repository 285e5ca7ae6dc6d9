"""Exception types of superneurons.

Every error a user can cause (a bad spec string, a budget below the minimum, a config mismatch
across ranks) is a :class:`ConfigError` whose message says what to do; the CLI prints it as one
line instead of a traceback.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """Bad user input: the message names the problem and the fix."""
