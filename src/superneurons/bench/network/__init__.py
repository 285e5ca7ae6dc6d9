"""``superneurons bench network``: data-parallel step time of every codec over shaped links.

:mod:`.run` starts the ranks per (world size, bandwidth, model) and collects the records;
:mod:`.worker` is one rank (a process of its own, inside its namespace) and :mod:`.data` its
batches; :mod:`.report` writes the artifacts, with the checks across world sizes
(:mod:`.scale`) and the cost model's step times at sizes and rates not run (:mod:`.extrapolate`).
"""
