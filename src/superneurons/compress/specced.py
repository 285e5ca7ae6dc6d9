"""The one thing every node of a composed compression has: a canonical spec string.

Wrappers (``ErrorFeedback``, ``Warmup``, ``Scheduled``, ``RowSparse``) hold their ``inner`` as a
:class:`Specced`; :func:`superneurons.compress.compose.unwrap` checks the real types. A leaf
module, so the wrapper modules need not import the composition (no import cycle).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Specced"]


@runtime_checkable
class Specced(Protocol):
    """Anything with a canonical spec string that :func:`~superneurons.compress.parse_spec`
    parses back."""

    @property
    def spec(self) -> str: ...
