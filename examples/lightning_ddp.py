"""FFT-compressed gradients in PyTorch Lightning, through DDPStrategy's comm-hook arguments.

    python examples/lightning_ddp.py --devices 2 --max-steps 50

Lightning registers the hook itself, after the process group exists;
``DeferredCompression`` validates the codec now and binds at the first backward. On CUDA a
plain ``DDPStrategy(ddp_comm_state=compression, ddp_comm_hook=deferred_compression_hook)``
works; ``CompressedDDPStrategy`` is that same strategy, also registering the hook on CPU, where
Lightning itself skips it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Subset

from superneurons.compress.deferred import DeferredCompression
from superneurons.data import build_dataset
from superneurons.integrations.lightning import CompressedDDPStrategy
from superneurons.models import build_model


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
    compression = DeferredCompression(model, args.compress)  # validated here, bound later
    strategy = CompressedDDPStrategy(compression, process_group_backend="gloo")
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
    state = compression.bind()
    if state.bytes_sent_total == 0:
        raise RuntimeError("the compression hook never ran")
    if trainer.is_global_zero:
        args.out.mkdir(parents=True, exist_ok=True)
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
