"""Optimizers that communicate compressed state themselves: 1-bit Adam and ``auto`` for Adam.

:mod:`.adam` is :class:`CompressedAdamW` (ranks exchange compressed momentum or updates,
Tang et al., ICML 2021); :mod:`.autoadam` decides between dense AdamW and 1-bit Adam from the
cost model (:mod:`superneurons.strategy`). DDP must leave gradients local with them
(:func:`superneurons.ddp.local.register_local_gradients`).
"""
