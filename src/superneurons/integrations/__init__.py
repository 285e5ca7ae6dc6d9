"""Integrations with training frameworks (optional dependencies, imported on demand).

* :mod:`.hf`: ``plan_for_batch`` — a memory plan for a model trained as ``model(**batch).loss``;
* :mod:`.accelerate`: ``prepare_superneurons`` — plan and compression after
  ``accelerator.prepare`` (``pip install superneurons[hf]``);
* :mod:`.transformers`: ``SuperNeuronsCallback`` — the same from ``transformers.Trainer``;
* :mod:`.lightning`: ``CompressedDDPStrategy`` — comm hooks on every device
  (``pip install superneurons[lightning]``).
"""
