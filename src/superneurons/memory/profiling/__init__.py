"""Profiling one training step: ``step`` (``profile_step``) runs the user's own model once,
``isolate``-d so that its training state is left as it was, while ``recording`` follows every
saved activation and ``from_recording`` turns the record into a
:class:`~superneurons.memory.profile_types.Profile`; ``owners`` and ``workspace`` say what the
step's storages belong to; ``weights`` what quantized parameters hold beside their data;
``below`` profiles the same step with its widest layers in chunks.
"""
