"""The runs of test_integrations_host_step: ``records`` in the test's process (one rank) or under
torchrun through two_rank_runs.py (two gloo ranks; the script alone is what
benchmarks/trainer_host_optimizer.py runs): the optimizer on the host under a trainer's own
loop, against the same loop without superneurons.

* TRL's ``SFTTrainer`` (tests/trl_support.py) with ``max_grad_norm=1.0``,
  ``gradient_accumulation_steps=2``, a cosine schedule with warm-up, weight decay (Trainer's
  groups: matrices only) and ``SuperNeuronsCallback(strategy="offload+host-optimizer")``; and the
  same stopped at step 3 and resumed from its checkpoint;
* the same through an Accelerate loop on the same tiny Llama (``accelerator.accumulate`` over
  2 micro-batches, ``clip_grad_norm_`` to 1.0, a cosine schedule with warm-up, weight decay on
  matrices only) with ``prepare_superneurons``, run straight and stopped at step 3, saved,
  rebuilt and resumed (one rank: no DDP, ``sync_gradients`` says which micro-batch is the
  last; two: DDP rebuilt in place, ``no_sync``).

Writes rank<R>.json. ``--model full``: the tiny Llama of the targets (hidden 256, 4 layers,
vocabulary 32000; benchmarks/trainer_host_optimizer.py) instead of the test's narrow one.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trl_support  # noqa: E402

HOST = "offload+host-optimizer"
STEPS = 5
STOP = 3
SFT = {
    "max_grad_norm": 1.0,
    "gradient_accumulation_steps": 2,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 1,
    "weight_decay": 0.1,
    # NOTE: the host optimizer runs PyTorch's fused CPU AdamW; the reference runs the same
    # kernel (Trainer's default optimizer name for torch >= 2.8), so the two can be bitwise
    "optim": "adamw_torch_fused",
    "max_steps": STEPS,
    "per_device_train_batch_size": 4,
}


def trl_runs(out: Path) -> dict[str, Any]:
    """Eager, host, and host stopped at ``STOP`` then resumed from its checkpoint."""
    kw: dict[str, Any] = {"packing": False, "bf16": False}
    host = {"budget_fraction": 1.0, "strategy": HOST}
    record = {
        "eager": trl_support.run(out / "eager", sft=SFT, **kw),
        "host": trl_support.run(out / "host", sft=SFT, **host, **kw),
    }
    trl_support.run(out / "stopped", sft=SFT, save_steps=STOP, stop_at=STOP, **host, **kw)
    checkpoint = out / "stopped" / f"checkpoint-{STOP}"
    record["saved"] = sorted(p.name for p in checkpoint.glob("superneurons-*"))
    record["resumed"] = trl_support.run(
        out / "resumed", sft=SFT, resume=checkpoint, save_steps=STOP, **host, **kw
    )
    return record


def accelerate_run(host: bool, steps: range, saved: dict[str, Any] | None = None) -> Any:
    """An Accelerate loop on the TRL runs' tiny Llama, as those runs train it: 2 micro-batches
    per step, clipping to ``max_grad_norm``, a cosine schedule with one warm-up step, weight
    decay on matrices only; with ``host``, ``prepare_superneurons`` stepping the optimizer on
    the host. Returns (record, what a checkpoint holds)."""
    from accelerate import Accelerator
    from transformers import get_cosine_schedule_with_warmup

    from superneurons.integrations.accelerate import prepare_superneurons
    from superneurons.memory.offload.handover import inner_optimizer

    accelerator = Accelerator(
        cpu=True, gradient_accumulation_steps=SFT["gradient_accumulation_steps"]
    )
    rank = accelerator.process_index
    model = trl_support.model(len(_tokenizer()))  # the TRL runs' Llama, seeded
    unwrap = accelerator.unwrap_model
    decay = [p for p in model.parameters() if p.ndim >= 2]  # matrices: Trainer's groups
    rest = [p for p in model.parameters() if p.ndim < 2]  # norms (a Llama has no biases)
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": SFT["weight_decay"]},
            {"params": rest, "weight_decay": 0.0},
        ],
        lr=1e-2,
        fused=True,
    )
    # accelerate steps a prepared scheduler once per process each optimizer step
    total = STEPS * accelerator.num_processes
    scheduler = get_cosine_schedule_with_warmup(optimizer, accelerator.num_processes, total)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if saved is not None:  # what the loop saves of its own, loaded as Trainer does
        unwrap(model).load_state_dict(saved["model"])
        scheduler.load_state_dict(saved["scheduler"])
        optimizer.load_state_dict(saved["optimizer"])
    setup = None
    if host:
        setup = prepare_superneurons(
            accelerator, model, sample_batch=_batch(1), budget_fraction=1.0,
            optimizer=optimizer, strategy=HOST, max_grad_norm=SFT["max_grad_norm"],
        )  # fmt: skip
        assert setup.plan is not None and setup.plan.host_optimizer
        if saved is not None:
            setup.load_state_dict(saved["setup"])
    losses, norms = [], []
    for step in steps:
        for micro in range(2):
            torch.manual_seed(1000 * step + 10 * micro + rank)  # any dropout
            with accelerator.accumulate(model):
                loss = model(**_batch(2 * STEPS * rank + 2 * step + micro))["loss"]
                accelerator.backward(loss)
                losses.append(float(loss.detach()))
                if accelerator.sync_gradients:
                    clip = SFT["max_grad_norm"]
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), clip)))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    state = setup.state_dict()["host_optimizer"]["optimizer"] if setup else None
    inner = inner_optimizer(optimizer)
    assert inner is not None
    record = {
        "losses": losses,
        "norms": norms,
        "params": trl_support.params_sha256(unwrap(model)),
        "optimizer_state": _state_sha256(state if state is not None else inner.state_dict()),
        # DDP rebuilt to hold the gradients of one parameter while the plan ran
        "ddp_ignores": len(getattr(model, "parameters_to_ignore", ())),
    }
    saved_now = {
        "model": {k: v.clone() for k, v in unwrap(model).state_dict().items()},
        "scheduler": scheduler.state_dict(),
        "optimizer": optimizer.state_dict(),
        "setup": setup.state_dict() if setup is not None else None,
    }
    if setup is not None:
        setup.remove()
        record["restored_ignores"] = len(getattr(model, "parameters_to_ignore", ()))
    return record, saved_now


def _batch(seed: int) -> dict[str, torch.Tensor]:
    """The TRL runs' texts 4 * seed to 4 * seed + 3, tokenized by their tokenizer (the Llama
    shifts the labels); each rank's micro-batches are others' (different gradients to average)."""
    texts = trl_support.texts()
    picks = texts[4 * seed : 4 * seed + 4]
    ids = torch.tensor(_tokenizer()(picks)["input_ids"])  # (4, 30)
    return {"input_ids": ids, "labels": ids}


@functools.cache
def _tokenizer() -> Any:
    return trl_support.tokenizer()


def _state_sha256(state_dict: dict[str, Any]) -> str:
    import hashlib

    sha = hashlib.sha256()
    state = state_dict["state"]
    for index in sorted(state):
        for key in sorted(state[index]):
            tensor = state[index][key].detach().contiguous().reshape(-1)
            sha.update(f"{index}.{key}".encode() + tensor.view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def accelerate_runs() -> dict[str, Any]:
    eager, _ = accelerate_run(False, range(STEPS))
    host, _ = accelerate_run(True, range(STEPS))
    _, saved = accelerate_run(True, range(STOP))
    resumed, _ = accelerate_run(True, range(STOP, STEPS), saved)
    return {"eager": eager, "host": host, "resumed": resumed}


def records(out: Path) -> dict[str, Any]:
    """This process's record (its rank's when under torchrun): both loops, as ``main`` writes."""
    two = int(os.environ.get("WORLD_SIZE", "1")) > 1
    record: dict[str, Any] = {"trl": trl_runs(out), "accelerate": accelerate_runs()}
    record["world_size"] = 2 if two else 1
    return record


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    if "--model" in sys.argv and sys.argv[sys.argv.index("--model") + 1] == "full":
        trl_support.use_full_model()
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps(records(out)) + "\n")


if __name__ == "__main__":
    from superneurons.train.rank import exit_rank

    main()
    exit_rank(0)  # barrier, destroy, exit without racing gloo's threads (pytorch#179291)
