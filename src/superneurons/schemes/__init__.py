"""Compression schemes: what a ``--compress`` spec names, and the one grammar that writes and
reads it.

A scheme is a base reduction (a codec, PowerSGD, one of PyTorch's anchors or ``auto``) inside
any number of wrappers. :mod:`.grammar` maps spec strings to scheme objects and back
(``CODECS``, ``SPECS``, ``WRAPPERS``, ``parse_spec``); :mod:`.compose` flattens a scheme into the
``Pipeline`` the hook reads; :mod:`.anchors` (PyTorch's own reductions) and :mod:`.auto` (the
per-bucket choice) are the configs a spec names that are not codecs. Pure: their run-time is
:mod:`superneurons.ddp`.
"""
