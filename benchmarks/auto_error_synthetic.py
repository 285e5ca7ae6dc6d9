"""One-shot errors of ``auto``'s candidates on the network benchmark's own ResNet gradients.

``superneurons bench network`` trains on ``models.model_input``: random images and random
labels. This prints, for 8 consecutive SGD steps from the bench's initial weights, the one-shot
``‖ĝ−g‖/‖g‖`` of each candidate on the largest gradient (the conv of 256 x 2304), measured the
way ``auto`` measures it (``strategy.measure_codecs``), to set beside the same figure on
Fashion-MNIST in ``benchmarks/results/network/auto/error_budget.json``.

    PYTHONPATH=src python benchmarks/auto_error_synthetic.py
"""

import torch

from superneurons.models import build_model, default_loss, model_input
from superneurons.strategy import DEFAULT_CANDIDATES, measure_codecs

MODEL = {"depth": 18, "small_input": True, "in_channels": 1, "num_classes": 10, "width": 32}

if __name__ == "__main__":
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("resnet", **MODEL)
    loss_fn = default_loss("resnet")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    candidates = [c for c in DEFAULT_CANDIDATES if c.spec.startswith(("powersgd", "topk", "qsgd"))]
    for step in range(8):
        x, y = model_input("resnet", 32, generator=gen, **MODEL)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        grad = max((p.grad for p in model.parameters() if p.grad is not None), key=torch.numel)
        costs = measure_codecs(candidates, grad.reshape(grad.shape[0], -1), repeats=1)
        print(step, {c.spec: round(c.rel_error, 3) for c in costs}, flush=True)
        opt.step()
