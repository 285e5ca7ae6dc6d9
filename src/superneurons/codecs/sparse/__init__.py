"""The sparsifiers: codecs that send ``k`` of ``n`` coefficients and their positions, gathered
from every rank and summed by ``decode_sum``.

:mod:`.topk` (spatial Top-k at 64 bits per kept element, the usual baseline), :mod:`.compacttopk`
(the same selection coded as FFT codes its bins: the fair baseline) and :mod:`.fft` (HPDC'20's
frequency-domain sparsifier, with its CPU pipeline in cache-sized row blocks in :mod:`.blocks`).
They share the kept-coefficient coding of :mod:`superneurons.codecs.coding.sparsecode`.
"""
