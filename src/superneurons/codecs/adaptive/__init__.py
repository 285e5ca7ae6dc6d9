"""The transform-adaptive codec (``adaptive``): per chunk the basis that compacts it best.

:mod:`.codec` is the codec (:class:`AdaptiveCodec`: basis choice, selection, payload);
:mod:`.bases` the three orthonormal bases and the per-chunk operations across them;
:mod:`.switches` the ``header="sparse"`` switch header.
"""

from __future__ import annotations

from superneurons.codecs.adaptive.codec import AdaptiveCodec

__all__ = ["AdaptiveCodec"]
