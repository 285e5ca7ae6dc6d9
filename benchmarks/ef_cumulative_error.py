"""Error of the cumulative update under error feedback vs the one-shot error, on real gradients.

For benchmarks/results/network/auto/README.md (auto's error budget): the network
benchmark's ResNet-18 (width 32) on Fashion-MNIST, one process, dense SGD; the largest layer's
gradient at steps 6-13 is compressed with error feedback (``c = g + e; s = C(c); e = c - s``)
and ``‖Σ s − Σ g‖ / ‖Σ g‖`` is compared with the one-shot ``‖C(g) − g‖ / ‖g‖`` of the first.

    PYTHONPATH=src python benchmarks/ef_cumulative_error.py
"""

import torch
from torch import nn

from superneurons.codecs.powersgd import PowerSGD, orthogonalize_
from superneurons.data import fashion_mnist
from superneurons.models.zoo import build_model
from superneurons.schemes.grammar import parse_spec

MODEL = {"depth": 18, "small_input": True, "in_channels": 1, "num_classes": 10, "width": 32}
SPECS = ["fp16", "powersgd:rank=1", "powersgd:rank=4", "topk:ratio=0.1", "topk:ratio=0.01", "qsgd"]


def gradients() -> list[torch.Tensor]:
    x, y = fashion_mnist("/usr/share/datasets/fashion-mnist", "train").tensors
    torch.manual_seed(0)
    model = build_model("resnet", **MODEL)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    largest = max(model.parameters(), key=lambda p: p.numel())
    out = []
    for step in range(14):
        idx = torch.arange(step * 64, (step + 1) * 64)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        if step >= 6:
            assert largest.grad is not None
            out.append(largest.grad.detach().reshape(largest.shape[0], -1).clone())
        opt.step()
    return out


def errors(spec: str, grads: list[torch.Tensor]) -> tuple[float, float]:
    """(one-shot error on the first gradient, error of the cumulative update)."""
    codec = parse_spec(spec)
    residual = torch.zeros_like(grads[0])
    q = None
    sent_sum, grad_sum = torch.zeros_like(grads[0]), torch.zeros_like(grads[0])
    one_shot = []
    for grad in grads:
        corrected = grad + residual
        if isinstance(codec, PowerSGD):
            if q is None:
                gen = torch.Generator().manual_seed(0)
                q = torch.randn(corrected.shape[1], codec.rank, generator=gen)
            p_hat = orthogonalize_(corrected @ q)
            q = corrected.t() @ p_hat
            sent = p_hat @ q.t()
        else:
            sent = codec.decode(codec.encode(corrected.reshape(-1))).view_as(grad)
        one_shot.append(float((sent - corrected).norm() / corrected.norm()))
        residual = corrected - sent
        sent_sum += sent
        grad_sum += grad
    return one_shot[0], float((sent_sum - grad_sum).norm() / grad_sum.norm())


if __name__ == "__main__":
    torch.set_num_threads(1)
    grads = gradients()
    print("shape", tuple(grads[0].shape))
    for spec in SPECS:
        first, cumulative = errors(spec, grads)
        print(f"{spec}: one-shot {first:.3f}, cumulative update over 8 steps {cumulative:.3f}")
