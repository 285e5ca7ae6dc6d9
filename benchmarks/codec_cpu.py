"""CPU seconds of each gathered codec on the fc-heavy model's gradient, bucket by bucket.

    .venv/bin/python benchmarks/codec_cpu.py > benchmarks/results/network/codec_cpu.txt

Splits the fc-heavy model's parameter count into 25 MiB DDP-sized buckets and times, on one
thread with ``time.process_time`` (immune to other processes), ``encode`` of one rank's bucket
and ``decode_sum`` of two ranks' payloads, plus the wire time of the payload at the goodputs
measured through our tbf-shaped veth links (96 Mbit/s and 964 Mbit/s). Explains how much of the
network benchmark's step is codec CPU rather than wire time.
"""

from __future__ import annotations

import time

import torch

from superneurons.models import build_model, default_loss, model_input
from superneurons.schemes.grammar import parse_spec

BUCKET_ELEMENTS = 25 * 2**20 // 4  # DDP's default bucket_cap_mb=25, fp32


def main() -> None:
    torch.set_num_threads(1)
    model = build_model("fc-heavy")
    inputs, targets = model_input("fc-heavy", 32)
    loss_fn = default_loss("fc-heavy")
    numel = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    compute_s = 0.0
    for _ in range(3):  # the last of three steps: warm
        start = time.process_time()
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()
        optimizer.step()
        compute_s = time.process_time() - start
    print(f"params {numel} compute step cpu {compute_s:.3f}s")
    sizes = [min(BUCKET_ELEMENTS, numel - s) for s in range(0, numel, BUCKET_ELEMENTS)]
    for spec in ("fft", "topk", "qsgd", "terngrad", "signsgd"):
        codec = parse_spec(spec)
        encode_s = decode_s = 0.0
        for size in sizes:
            grad = torch.randn(size) * 1e-3
            start = time.process_time()
            mine = codec.encode(grad)
            encode_s += time.process_time() - start
            theirs = codec.encode(torch.randn(size) * 1e-3)
            start = time.process_time()
            codec.decode_sum([mine, theirs])
            decode_s += time.process_time() - start
        payload_bytes = sum(codec.payload_bytes(size) for size in sizes)
        print(
            f"{spec:10s} encode {encode_s:.3f}s decode_sum(2) {decode_s:.3f}s "
            f"payload {payload_bytes / 1e6:.2f}MB CR {4 * numel / payload_bytes:.1f} "
            f"wire@96Mbit {payload_bytes * 8 / 96e6:.3f}s "
            f"wire@964Mbit {payload_bytes * 8 / 964e6:.3f}s"
        )


if __name__ == "__main__":
    main()
