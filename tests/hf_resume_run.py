"""The run of test_integrations_hf, under torchrun through two_rank_runs.py (2 gloo ranks; also
runnable alone as a script): Trainer + SuperNeuronsCallback
with FFT compression and error feedback, uninterrupted vs stopped at step 2 and resumed from
its checkpoint (with and without the saved compression state). Writes rank<R>.json."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from superneurons.integrations.transformers import SuperNeuronsCallback

STEPS, STOP = 4, 2


class _StopAt(TrainerCallback):  # type: ignore[misc]
    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == STOP:
            control.should_training_stop = True


def _run(out: Path, *, stop: bool = False, resume: Path | None = None) -> str:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (64, 32), generator=torch.Generator().manual_seed(1))
    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=3e-3,
        save_strategy="steps" if stop else "no",
        save_steps=STOP,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    data = [{"input_ids": x, "labels": x} for x in ids]
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(SuperNeuronsCallback(trainer, compression="fft:theta=0.9,bits=8"))
    if stop:
        trainer.add_callback(_StopAt())
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        sha.update(name.encode() + tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def records(out: Path) -> dict[str, Any]:
    """This rank's record, as ``main`` writes it."""
    rank = int(os.environ["RANK"])
    record: dict[str, Any] = {"uninterrupted": _run(out / "a")}
    _run(out / "b", stop=True)
    checkpoint = out / "b" / f"checkpoint-{STOP}"
    record["saved"] = sorted(p.name for p in checkpoint.glob("superneurons-*"))
    record["resumed"] = _run(out / "b", resume=checkpoint)
    torch.distributed.barrier()
    if rank == 0:
        for path in checkpoint.glob("superneurons-*"):
            path.unlink()
    torch.distributed.barrier()
    record["resumed_without_state"] = _run(out / "c", resume=checkpoint)
    return record


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    (out / f"rank{rank}.json").write_text(json.dumps(records(out)) + "\n")


if __name__ == "__main__":
    from superneurons.train.rank import exit_rank

    main()
    exit_rank(0)
