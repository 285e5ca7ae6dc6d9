"""Running a plan in an ordinary eager training loop: ``apply`` (``apply_plan``: hooks on the
user's model, undone on exit), ``recompute`` (a unit's forward again in backward), ``stateful``
(KV caches and modules that write state under a plan), ``compiled`` (a plan under
``torch.compile``).
"""
