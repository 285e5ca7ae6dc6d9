"""Data-parallel training with gradient compression, launched through torchrun.

Examples:
  superneurons train --model mlp --data fashion-mnist --nproc 2 --compress fft:theta=0.9,bits=8
  superneurons train --model gpt --data shakespeare --nproc 4 --compress powersgd:rank=4 \\
      --optimizer adamw --epochs 2 --out runs/gpt-psgd
  superneurons train ... --out runs/x --resume          # continue from runs/x/checkpoint
  superneurons train ... --max-restarts 3 --checkpoint-every 50   # survive a lost rank

Writes OUT/metrics.jsonl, OUT/summary.json, OUT/config.json and OUT/checkpoint/rank*.pt
(the previous checkpoint kept as rank*.prev.pt until a new one is complete; --resume continues
from the newest step every rank can read). Without --resume a run starts over in OUT.
--checkpoint-every STEPS also saves inside an epoch; with --max-restarts N torchrun restarts
every rank after one fails (up to N times) and they continue from the newest checkpoint every
rank can read, by themselves (summary.json lists each resume under "resumes").
Progress: a live bar when stderr is a terminal, a plain line every ~10 s otherwise.
Started by your own torchrun (RANK/WORLD_SIZE/LOCAL_RANK set), it runs as that rank instead.
--compress takes a codec spec (ctopk, adaptive, fft, rangefloat, topk, qsgd, terngrad, signsgd,
identity, fp16, bf16, powersgd:rank=R), a wrapper around one (ef(...), warmup(steps=N,...),
rowsparse(...)), a PyTorch anchor (dense, torch-fp16, torch-powersgd:rank=R) or auto (chosen
per bucket from the measured network and backward timeline, among codecs whose one-shot relative
error is within auto:max_rel_error=0.6; auto:max_rel_error_lowrank=0.8 also admits PowerSGD
rank 4 on conv gradients, which cost accuracy in our runs).
With --optimizer adamw (or adam), --compress may also name an optimizer that communicates itself:
adam-momentum[warmup=N,wire=fp16]:signsgd (1-bit Adam) or adam-update[...]:CODEC; and auto then
chooses between dense AdamW and 1-bit Adam by the predicted step time (auto:link=100mbit plans
for a stated link instead of the measured one).
  superneurons train --model gpt --data shakespeare --nproc 2 --optimizer adamw \\
      --compress "adam-momentum[warmup=20,wire=fp16]:signsgd" --out runs/gpt-1bit
--sync diloco:steps=H (DiLoCo, for slow links) averages nothing per step: every rank runs its
optimizer on its own shard, and every H steps (and at each epoch's end) the outer gradient is
averaged and an outer Nesterov step taken (lr=0.7,momentum=0.9); diloco[steps=H]:CODEC sends
the outer gradient through a codec or the two-phase all-reduce (diloco[steps=H]:twophase:bits=4),
with error feedback unless --no-error-feedback.
  superneurons train --model gpt --data shakespeare --nproc 4 --optimizer adamw \\
      --sync "diloco[steps=25]:fp16" --out runs/gpt-diloco
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from superneurons.bytesize import parse_bytes
from superneurons.errors import ConfigError
from superneurons.train.config import TrainConfig

__all__ = ["HELP", "add_arguments", "config_from_args", "run"]

HELP = "data-parallel training with compressed gradients (torchrun, checkpoint/resume)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    run_group = parser.add_argument_group("what to train")
    run_group.add_argument(
        "--model", required=True, help="mlp, resnet, fc-heavy, alexnet, gpt, lstm"
    )
    run_group.add_argument("--data", required=True, help="fashion-mnist or shakespeare")
    run_group.add_argument("--data-dir", default=None, help="directory of the dataset files")
    run_group.add_argument("--out", required=True, help="output directory")
    run_group.add_argument("--epochs", type=int, default=1)
    run_group.add_argument("--batch-size", type=int, default=64, help="per rank")
    run_group.add_argument("--lr", type=float, default=None, help="default: 0.05 sgd, 1e-3 adam(w)")
    run_group.add_argument("--optimizer", default="sgd", help="sgd (momentum 0.9), adam, adamw")
    run_group.add_argument("--seed", type=int, default=0)
    run_group.add_argument("--block-size", type=int, default=128, help="sequence length (LMs)")
    run_group.add_argument(
        "--limit-steps", type=int, default=None, help="at most N steps (and test batches) per epoch"
    )
    run_group.add_argument("--log-every", type=int, default=10, help="steps between metric lines")
    run_group.add_argument(
        "--resume",
        action="store_true",
        help="continue from OUT/checkpoint (without it, a run starts over in OUT)",
    )
    run_group.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="STEPS",
        help="also checkpoint every STEPS steps inside an epoch (default: at epoch ends only); "
        "a failed run loses at most this many steps",
    )
    run_group.add_argument(
        "--budget",
        default=None,
        help="device memory budget (e.g. 2GiB): plan keep/offload/recompute",
    )
    run_group.add_argument(
        "--max-grad-norm",
        type=float,
        default=0.0,
        help="clip the averaged gradients to this global norm before each step (0: no "
        "clipping); with the optimizer on the host the step waits for the norm",
    )
    comm = parser.add_argument_group("communication")
    comm.add_argument(
        "--compress",
        default="dense",
        help="codec spec, anchor, auto, or with adam(w) adam-momentum[...]:CODEC (see above)",
    )
    comm.add_argument(
        "--sync",
        default="every-step",
        help="every-step (gradients through --compress) or DiLoCo: diloco:steps=H[,lr=0.7,"
        "momentum=0.9,nesterov=true], diloco[steps=H,...]:CODEC (see above)",
    )
    comm.add_argument("--warmup-steps", type=int, default=0, help="dense steps before compressing")
    comm.add_argument(
        "--no-error-feedback", action="store_true", help="drop what compression loses"
    )
    comm.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size")
    comm.add_argument(
        "--backend",
        default="auto",
        help="auto: nccl with one GPU per rank, else every rank on CPU with gloo (said in one "
        "line); nccl: one GPU per rank, stops before launching if there are fewer; gloo: CPU",
    )
    launch = parser.add_argument_group("launch (torchrun)")
    launch.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="ranks on this node (one GPU each under NCCL; see --backend for fewer GPUs)",
    )
    launch.add_argument("--nnodes", type=int, default=1)
    launch.add_argument("--node-rank", type=int, default=0)
    launch.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous")
    launch.add_argument("--master-addr", default=None, help="static rendezvous address instead")
    launch.add_argument("--master-port", type=int, default=29500)
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="torchrun restarts every rank after one fails, up to N times; they resume from the "
        "newest checkpoint every rank can read (see --checkpoint-every)",
    )


def _say_backend(nproc: int, backend: str, *, first: bool) -> None:
    """The GPU policy for ``nproc`` ranks on this node, before any starts: ``nccl`` without a
    GPU per rank is a ConfigError saying what to pass; ``auto`` with too few GPUs is one line
    (every rank on CPU with gloo)."""
    from superneurons.train.launch import Launch, check_launch

    note = check_launch(Launch(nproc=nproc), backend).note
    if note is not None and first:
        print(f"superneurons: {note}", file=sys.stderr, flush=True)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run these parsed arguments describe (what every rank reads back)."""
    return TrainConfig(
        model=args.model,
        data=args.data,
        out_dir=str(Path(args.out).resolve()),
        compress=args.compress,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        optimizer=args.optimizer,
        seed=args.seed,
        limit_steps=args.limit_steps,
        bucket_cap_mb=args.bucket_cap_mb,
        warmup_steps=args.warmup_steps,
        error_feedback=not args.no_error_feedback,
        data_dir=args.data_dir,
        block_size=args.block_size,
        log_every=args.log_every,
        backend=args.backend,
        resume=args.resume,
        budget_bytes=parse_bytes(args.budget) if args.budget is not None else None,
        sync=args.sync,
        checkpoint_every=args.checkpoint_every,
        max_grad_norm=args.max_grad_norm,
    )


def run(args: argparse.Namespace) -> int:
    from superneurons.train.launch import Launch, run_torchrun, under_torchrun
    from superneurons.train.precheck import check_before_launch
    from superneurons.train.task import check_task

    config = config_from_args(args)
    launch = Launch(
        nproc=args.nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
    )
    # Validate here, before any rank starts: bad input is one line, never a rank traceback
    # (TrainConfig has parsed --compress into config.scheme, the one parse in this process).
    check_task(config.model, config.data)
    _check_data(config)
    if under_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
        shared = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) == world_size
    else:
        world_size, shared = launch.nproc * launch.nnodes, launch.nnodes == 1
    resume_point = check_before_launch(config, world_size=world_size, shared_files=shared)
    if resume_point is not None and resume_point.skipped:
        print(
            f"superneurons: resuming from step {resume_point.step}; skipped "
            f"{'; '.join(resume_point.skipped)}",
            file=sys.stderr,
        )
    if under_torchrun():  # started by the user's own torchrun: be a rank, launch nothing
        from superneurons.train.loop import train

        if launch.max_restarts:
            raise ConfigError("--max-restarts is torchrun's here: pass it to your torchrun")
        nproc = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        _say_backend(nproc, config.backend, first=os.environ["LOCAL_RANK"] == "0")

        train(config)
        from superneurons.train.rank import exit_rank

        exit_rank(0)  # a rank's process ends here (an abort at exit otherwise: see exit_rank)
    _say_backend(launch.nproc, config.backend, first=True)  # before any rank starts
    if not config.resume and shared:
        _start_over(config, world_size)
    config_path = config.save(Path(config.out_dir) / "config.json")
    status = run_torchrun(launch, config_path)
    if status != 0:
        raise ConfigError(f"training failed (exit status {status}); see the rank errors above")
    summary_path = Path(config.out_dir) / "summary.json"
    if summary_path.exists():
        print(summary_path.read_text(encoding="utf-8").strip())
    return 0


def _start_over(config: TrainConfig, world_size: int) -> None:
    """A run without --resume removes an earlier run's checkpoint before any rank starts, so
    that workers restarted by torchrun (--max-restarts) can only ever resume this run's."""
    from superneurons.train.checkpoint import remove_checkpoints

    removed = [p for rank in range(world_size) for p in remove_checkpoints(config.out_dir, rank)]
    if removed:
        print(
            f"superneurons: starting over in {config.out_dir}: removed the earlier run's "
            "checkpoint (pass --resume to continue a run instead)",
            file=sys.stderr,
        )


def _check_data(config: TrainConfig) -> None:
    """``--data-dir`` is a directory (check_before_launch then reads the files)."""
    from superneurons.train.precheck import check_data_dir

    check_data_dir(config)
