"""What a ``--compress`` spec names, and the one grammar that writes and reads it.

:mod:`.grammar` maps spec strings to objects and back (``CODECS``, ``SPECS``, ``WRAPPERS``,
``parse_spec``); :mod:`.compose` flattens a composed compression into the ``Pipeline`` the hook
reads; :mod:`.anchors` (PyTorch's own reductions) and :mod:`.auto` (the per-bucket choice) are
the configs a spec names that are not codecs. Pure: their run-time is :mod:`superneurons.ddp`.
"""
