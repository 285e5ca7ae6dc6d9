"""Gradient codecs: pure functions of a frozen config, from a flat gradient to bytes and back.

Nothing here touches a process group: :mod:`superneurons.ddp` moves the bytes.
:mod:`.coding` holds what the codecs share (bit packing, index and value coding, the NaN
policy, scratch buffers).
"""
