"""Sizing from a configuration, on fake tensors (no memory used, no weights read): ``target``
(what ``superneurons plan`` sizes: a zoo model or a causal LM), ``model_plan`` (``plan`` as one
call: the target's floors and plan), ``simulate`` (zoo models, and plans executed without
memory), ``llm`` (a Hugging Face causal LM from its ``config.json``: ``plan --model hf:``),
``search`` (the largest depth / batch / sequence that fits: ``plan --max-*``).
"""
