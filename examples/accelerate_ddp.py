"""A tiny GPT-2 in a plain Hugging Face Accelerate loop on 2 ranks, with a memory plan and
compressed gradient averaging applied after ``accelerator.prepare``.

    torchrun --nproc-per-node 2 examples/accelerate_ddp.py --steps 20 --out runs/accelerate

(or ``accelerate launch --num_processes 2 --cpu examples/accelerate_ddp.py``). Each rank writes
``rank<R>.json`` with a digest of its parameters: the ranks must agree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import NoReturn

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

from superneurons.integrations.accelerate import prepare_superneurons
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
    parser.add_argument("--out", type=Path, default=Path("runs/accelerate"))
    args = parser.parse_args()
    torch.set_num_threads(1)

    accelerator = Accelerator(cpu=True)
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(CountingTokens(512), batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    batches = iter(loader)
    first = next(batches)
    setup = prepare_superneurons(
        accelerator,
        model,
        compression=args.compress,
        sample_batch=first,
        budget_fraction=args.budget_fraction,
        strategy=args.strategy,
        optimizer=optimizer,
    )
    model.train()
    losses = []
    batch = first
    for _ in range(args.steps):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        batch = next(batches)
    setup.remove()

    state, plan = setup.compression, setup.plan
    assert state is not None and plan is not None
    record = {
        "rank": accelerator.process_index,
        "steps": len(losses),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "params_sha256": digest(accelerator.unwrap_model(model)),
        "codec": state.codec.spec,
        "compress_steps": state.step,
        "bytes_sent_total": state.bytes_sent_total,
        "dense_bytes_step": state.dense_bytes_step,
        "bytes_sent_step": state.bytes_sent_step,
        "plan": {u.fqn: u.action for u in plan.units},
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "budget_bytes": plan.budget_bytes,
        "plan_stats": setup.plan_handle.stats() if setup.plan_handle else None,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{record['rank']}.json").write_text(json.dumps(record, indent=1) + "\n")
    if accelerator.is_main_process:
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
