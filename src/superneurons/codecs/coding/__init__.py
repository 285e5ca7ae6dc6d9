"""What the codecs share to write their bytes: bit packing (:mod:`.bitpack`), index coding
(:mod:`.indexcode`), the range-based float (:mod:`.rangefloat`), a sparse message of kept
coefficients (:mod:`.sparsecode`), stochastic-rounding noise (:mod:`.noise`), the NaN policy
(:mod:`.finite`) and kept scratch buffers (:mod:`.workspace`). Pure; imports no codec.
"""
