"""A tiny GPT-2 trained by ``transformers.Trainer`` on 2 ranks, under a memory plan and with
FFT-compressed gradient averaging, through ``SuperNeuronsCallback``.

    torchrun --nproc-per-node 2 examples/hf_trainer.py --steps 20 --out runs/hf_trainer

CPU and gloo here (``use_cpu=True, ddp_backend="gloo"``); on GPUs drop both. The callback
profiles one real batch, plans keep / offload / recompute per GPT-2 block under
``--budget-fraction`` of the eager peak, and registers the compression hook on the DDP model
that Trainer builds in ``train()``. Each rank writes ``rank<R>.json`` with a digest of its
parameters: the ranks must agree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
from typing import NoReturn

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from superneurons.integrations.transformers import SuperNeuronsCallback
from superneurons.train import exit_rank

VOCAB = 128
SEQ = 64


class CountingTokens(Dataset):  # type: ignore[type-arg]
    """Synthetic, learnable sequences: ``x[t+1] = x[t] + step (mod VOCAB)``."""

    def __init__(self, n: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=gen)
        step = torch.randint(1, 8, (n, 1), generator=gen)
        self.ids = (start + step * torch.arange(SEQ)) % VOCAB  # (n, SEQ)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def digest(model: torch.nn.Module) -> str:
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        sha.update(name.encode())
        sha.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def main() -> NoReturn:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compress", default="fft:theta=0.9,bits=8")
    parser.add_argument("--budget-fraction", type=float, default=0.7)
    parser.add_argument(
        "--strategy",
        default="auto",
        help="the planner's: auto, checkpoint, recompute, offload, ...",
    )
    parser.add_argument("--repeat", type=int, default=1, help="call trainer.train() this often")
    parser.add_argument("--out", type=Path, default=Path("runs/hf_trainer"))
    args = parser.parse_args()
    torch.set_num_threads(1)

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=str(args.out / "trainer"),
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=8,
        max_steps=args.steps,
        learning_rate=3e-3,
        logging_steps=max(1, args.steps // 4),
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=training, train_dataset=CountingTokens(512))
    callback = SuperNeuronsCallback(
        trainer,
        compression=args.compress,
        budget_fraction=args.budget_fraction,
        strategy=args.strategy,
    )
    trainer.add_callback(callback)
    steps = 0
    for _ in range(args.repeat):  # a second train() keeps the DDP model and its hook
        result = trainer.train()
        steps += trainer.state.global_step

    setup = callback.setup
    assert setup is not None and setup.compression is not None and setup.plan is not None
    state = setup.compression
    record = {
        "rank": int(os.environ.get("RANK", 0)),
        "steps": steps,
        "train_loss": result.training_loss,
        "params_sha256": digest(model),
        "codec": state.codec.spec,
        "compress_steps": state.step,
        "bytes_sent_total": state.bytes_sent_total,
        "dense_bytes_step": state.dense_bytes_step,
        "bytes_sent_step": state.bytes_sent_step,
        "plan": {u.fqn: u.action for u in setup.plan.units},
        "predicted_peak_bytes": setup.plan.predicted_peak_bytes,
        "budget_bytes": setup.plan.budget_bytes,
        "plan_stats": setup.plan_handle.stats() if setup.plan_handle else None,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{record['rank']}.json").write_text(json.dumps(record, indent=1) + "\n")
    if record["rank"] == 0:
        print(json.dumps({k: v for k, v in record.items() if k != "plan_stats"}))
    # NOTE: the last line, while the model is alive: the ranks meet at a barrier (a rank leaving
    # while a peer's gloo threads still talk to it can abort the peer), leave the group and end
    # without finalisers. Returning first would release DDP's reducer: once the group is
    # destroyed (accelerate's `end_training()` does it), the reducer's destructor joins gloo's
    # threads holding the GIL one of them may need to release a tensor: a hang (see
    # superneurons.train.rank).
    exit_rank(0)


if __name__ == "__main__":
    main()
