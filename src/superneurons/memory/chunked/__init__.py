"""Below the largest layer: the widest layers run in chunks so that no working set is larger than
a block's. ``headloss``: the LM head + cross-entropy over chunks of tokens (the logits never exist
whole); ``lmhead``: the same on a causal LM as shipped (inside PEFT's wrappers too); ``fused``:
TRL's fused LM head with its own kernel over chunks of tokens; ``seqchunk``: position-wise
sub-layers (block MLPs, fp32-computing norms) over pieces of the sequence; ``adapter_inputs``:
LoRA adapters that save their input at the base's precision, not an fp32 copy per adapter.
"""
