"""The planner: a :class:`~superneurons.memory.profile_types.Profile` and a byte budget in, a
:class:`~superneurons.memory.plan.Plan` out. Pure: planning touches no tensor, and the planner
imports no runtime, offload or autograd module (``tests/test_house.py`` holds it to that).

``decide`` (across strategies: ``search_floors``, every strategy's floor; ``make_plan``, the
strategy and the Plan) -> ``strategy_search`` (one strategy: the shortest prefix of candidate
actions that fits) ->
``predict`` (a plan's peak and cost on the profile's timeline), with ``cost`` (the device model),
``bounds`` (the largest-layer bound), ``buckets`` and ``predict_steps`` (where the optimizer
steps) and ``where`` (where a peak is).
"""
