"""Integrations with training frameworks (optional dependencies, imported on demand).

* :mod:`.hf`: ``plan_for_batch`` — a memory plan for a model trained as ``model(**batch).loss``;
* :mod:`.accelerate`: ``prepare_superneurons`` — plan and compression after
  ``accelerator.prepare`` (``pip install superneurons[hf]``);
* :mod:`.transformers`: ``SuperNeuronsCallback`` — the same from ``transformers.Trainer``;
* :mod:`.lightning`: ``CompressedDDPStrategy`` — comm hooks on every device
  (``pip install superneurons[lightning]``).

Inside them: :mod:`.batch_step` (the trainer's step on one batch, profiled plain and below its
largest layer; PEFT and TRL models included) and :mod:`.no_trace` (a set-up that fails leaves
the model as it was).
"""
