"""``superneurons bench convergence``: does a codec reach dense DDP's accuracy in the same steps?

:mod:`.labels` reads the codec labels (once, into objects); :mod:`.run` holds the configuration
and starts the ranks, on loopback or over a shaped link (:mod:`.shaped`); :mod:`.rank` is what
one rank trains; :mod:`.report` writes the artifacts.
"""
