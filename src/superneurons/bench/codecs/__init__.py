"""``superneurons bench codecs``: every codec on real gradients at equal bit budgets
(:mod:`.budgets`, from gradients captured by :mod:`.gradients` on the zoo and on
:mod:`.hf_models`; artifacts by :mod:`.report`), and with ``--device`` encode/decode throughput
on one device (:mod:`.speed`).
"""
