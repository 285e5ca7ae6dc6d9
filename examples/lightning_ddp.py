"""FFT-compressed gradients in PyTorch Lightning, through ``CompressedDDPStrategy``.

    python examples/lightning_ddp.py --devices 2 --max-steps 50
    python examples/lightning_ddp.py --compress torch-fp16      # PyTorch's own hook, counted

The spec is validated when the strategy is built; the hook is registered once DDP wraps the
model, on every device (Lightning's ``DDPStrategy`` registers ``ddp_comm_hook`` only on CUDA
and silently skips it on CPU). Each rank writes ``rank<R>.json`` with a digest of its
parameters; rank 0 also writes ``result.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Subset

from superneurons.data import build_dataset
from superneurons.integrations.lightning import CompressedDDPStrategy
from superneurons.models import build_model
from superneurons.train import exit_rank


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = build_model("mlp")
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        images, labels = batch
        loss = self.loss_fn(self.net(images), labels)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--compress", default="fft:theta=0.9,bits=8")
    parser.add_argument("--out", type=Path, default=Path("runs/lightning"))
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Classifier()
    strategy = CompressedDDPStrategy(args.compress, process_group_backend="gloo")
    train = Subset(build_dataset("fashion-mnist", "train"), range(64 * args.max_steps))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(train, batch_size=32, shuffle=True))
    state = strategy.compression_state
    if state is None or state.bytes_sent_total == 0:
        raise RuntimeError("the compression hook never ran")
    args.out.mkdir(parents=True, exist_ok=True)
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        sha.update(name.encode() + tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    rank = {"rank": trainer.global_rank, "params_sha256": sha.hexdigest(), "steps": state.step}
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(rank) + "\n")
    if trainer.is_global_zero:
        result = {
            "codec": state.codec.spec,
            "final_loss": float(trainer.callback_metrics["loss"]),
            "bytes_sent_total": state.bytes_sent_total,
            "compression_ratio": state.dense_bytes_step / max(state.bytes_sent_step, 1),
            "steps": trainer.global_step,
        }
        (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result))


if __name__ == "__main__":
    main()
    exit_rank(0)  # leave the process group without racing gloo's threads (pytorch#179291)
