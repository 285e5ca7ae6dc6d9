"""Gradient codecs: pure functions of a frozen config, from a flat gradient to bytes and back.

:mod:`.codec` is the one interface (``Codec``, ``Payload``); the codecs are HPDC'20's
(:mod:`.sparse.fft`, :mod:`.rangefloat`), ours (:mod:`.adaptive`, :mod:`.sparse.compacttopk`)
and the baselines (:mod:`.cast`, :mod:`.sparse.topk`, :mod:`.qsgd`, :mod:`.terngrad`,
:mod:`.sign`), with PowerSGD's configuration and arithmetic (:mod:`.powersgd`). The sparsifiers
(Top-k, ``ctopk``, FFT) form :mod:`.sparse`. The wrappers that compose them: error feedback
(:mod:`.feedback`), θ schedules and a dense warm-up (:mod:`.schedule`), embeddings as rows
(:mod:`.rowsparse`). :mod:`.coding` holds what the codecs share to write their bytes. Nothing
here touches a process group (:mod:`superneurons.ddp` moves the bytes); the public import path is :mod:`superneurons.compress`.
"""
