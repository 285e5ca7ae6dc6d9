"""Exploration (not the benchmark): 2 ranks simulated in one process on the char-GPT.

Same model, data shards, order and hyper-parameters as ``bench convergence``'s Shakespeare
task (dense reproduces the 2-rank run's 2.4131 nats). Schemes: ``dense`` (Adam on the averaged
gradient), ``efgrad`` (error-fed compressed gradients into Adam), ``onebit`` (1-bit Adam: dense
warm-up, frozen v, error-fed compressed momentum), ``update`` (local Adam moments, error-fed
compressed updates). ``blocksign:B`` is a scaled sign with one fp16 scale per B elements.
Used to choose what ``optim/adam.py`` implements; results in
``benchmarks/results/convergence/sim/ablations.jsonl``.

  PYTHONPATH=src python benchmarks/convergence_sim.py '{"scheme":"onebit","codec_spec":"signsgd","warm":20}'
"""

import json
import sys
import time

import torch

from superneurons.bench.convergence.config import SHAKESPEARE, ConvergenceConfig
from superneurons.bench.convergence.rank import datasets, evaluate
from superneurons.models import build_model, default_loss
from superneurons.schemes.grammar import parse_spec

torch.set_num_threads(1)
P = 2
task = SHAKESPEARE
cfg = ConvergenceConfig(codecs=("dense",), tasks=(task,), shakespeare_root="data/shakespeare")
(xtr, ytr), (xte, yte) = datasets(task, cfg)


def run(
    scheme,
    codec_spec=None,
    warm=0,
    steps=200,
    lr=3e-3,
    wd=0.0,
    betas=(0.9, 0.999),
    eps=1e-8,
    seed=0,
    evals=5,
    theta_sched=None,
):
    torch.manual_seed(seed)
    model = build_model(task.model, **task.model_kwargs)
    loss_fn = default_loss(task.model)
    params = [p for p in model.parameters()]
    codec = None
    block = 0
    if codec_spec and codec_spec.startswith("blocksign:"):
        block = int(codec_spec.split(":")[1])
    elif codec_spec:
        codec = parse_spec(codec_spec)
    b1, b2 = betas
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    ml = [[torch.zeros_like(p) for p in params] for _ in range(P)]
    vl = [[torch.zeros_like(p) for p in params] for _ in range(P)]
    err = [[torch.zeros_like(p) for p in params] for _ in range(P)]
    shard = xtr.shape[0] // P
    spe = shard // task.batch_size
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(xtr.shape[0], generator=gen)
    bytes_total = 0
    dense_bytes = sum(4 * p.numel() for p in params)
    curve = []
    gen_c = torch.Generator().manual_seed(1)

    def C(x, r=0):
        nonlocal bytes_total
        flat = x.reshape(-1)
        if block:
            n = flat.numel()
            nb = -(-n // block)
            padded = torch.nn.functional.pad(flat, (0, nb * block - n)).view(nb, block)
            scale = padded.abs().sum(1, keepdim=True) / torch.tensor(
                [block] * (nb - 1) + [n - (nb - 1) * block]
            ).view(nb, 1)
            out = torch.where(padded < 0, -scale, scale).reshape(-1)[:n]
            bytes_total += (-(-n // 8) + 2 * nb) if r == 0 else 0
            return out.view_as(x)
        pl = codec.encode(flat, generator=gen_c)
        bytes_total += pl.nbytes if r == 0 else 0
        return codec.decode(pl).view_as(x)

    for step in range(1, steps + 1):
        i = (step - 1) % spe
        if i == 0 and step > 1:
            order = torch.randperm(xtr.shape[0], generator=gen)
        grads = []
        for r in range(P):
            idx = order[r * shard :][i * task.batch_size : (i + 1) * task.batch_size]
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model(xtr[idx]), ytr[idx])
            loss.backward()
            grads.append([p.grad.detach().clone() for p in params])
        bc1 = 1 - b1**step
        bc2 = 1 - b2**step
        with torch.no_grad():
            dense_phase = scheme == "dense" or step <= warm
            for j, p in enumerate(params):
                if dense_phase and scheme != "update":
                    bytes_total += 4 * p.numel()
                    g = sum(gr[j] for gr in grads) / P
                    m[j].mul_(b1).add_(g, alpha=1 - b1)
                    v[j].mul_(b2).addcmul_(g, g, value=1 - b2)
                    upd = (m[j] / bc1) / ((v[j] / bc2).sqrt() + eps)
                elif scheme == "efgrad":
                    qs = []
                    for r in range(P):
                        c = grads[r][j] + err[r][j]
                        q = C(c, r)
                        err[r][j] = c - q
                        qs.append(q)
                    g = sum(qs) / P
                    m[j].mul_(b1).add_(g, alpha=1 - b1)
                    v[j].mul_(b2).addcmul_(g, g, value=1 - b2)
                    upd = (m[j] / bc1) / ((v[j] / bc2).sqrt() + eps)
                elif scheme == "onebit":  # frozen v, compress momentum with EF
                    qs = []
                    for r in range(P):
                        mr = m[j] * b1 + grads[r][j] * (1 - b1)
                        c = mr + err[r][j]
                        q = C(c, r)
                        err[r][j] = c - q
                        qs.append(q)
                    m[j] = sum(qs) / P
                    upd = (m[j] / bc1) / ((v[j] / (1 - b2**warm)).sqrt() + eps)
                elif scheme == "update":  # local Adam, compress the update with EF
                    us = []
                    for r in range(P):
                        g = grads[r][j]
                        ml[r][j].mul_(b1).add_(g, alpha=1 - b1)
                        vl[r][j].mul_(b2).addcmul_(g, g, value=1 - b2)
                        u = (ml[r][j] / bc1) / ((vl[r][j] / bc2).sqrt() + eps)
                        if step <= warm:
                            us.append(u)
                            bytes_total += 4 * p.numel() if r == 0 else 0
                        else:
                            c = u + err[r][j]
                            q = C(c, r)
                            err[r][j] = c - q
                            us.append(q)
                    upd = sum(us) / P
                else:
                    raise ValueError(scheme)
                if wd:
                    p.mul_(1 - lr * wd)
                p.sub_(upd, alpha=lr)
        if step % (steps // evals) == 0:
            part = slice(0, task.eval_limit) if step == steps else slice(0, 2000)
            curve.append([step, round(evaluate(model, xte[part], yte[part], task.task), 4)])
    # bytes: only rank 0's share counted for compressed parts (C called P times) -> per rank
    return curve, bytes_total / steps, dense_bytes


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    t0 = time.time()
    c0 = time.process_time()
    out, bps, db = run(**spec)
    print(
        json.dumps(
            {
                "spec": spec,
                "final": out[-1][1],
                "ratio": round(db / bps, 2),
                "curve": out,
                "wall_s": round(time.time() - t0, 1),
                "cpu_s": round(time.process_time() - c0, 1),
            }
        ),
        flush=True,
    )
