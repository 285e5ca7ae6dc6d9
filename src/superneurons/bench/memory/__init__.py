"""The memory half's benchmarks.

``superneurons bench memory``: device peak and step time of one training step under our plans
against eager and the anchors (:mod:`.run`, :mod:`.anchors`, :mod:`.report`), measured by
:mod:`.meter`, which the memory tests and benchmarks share. ``superneurons bench deeper``: the
deepest ResNet and largest batch per strategy in 12 GiB, on fake tensors (:mod:`.deeper`).
"""
