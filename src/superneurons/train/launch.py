"""Starting ranks: re-launch through torchrun, and the rank entry point.

``superneurons train`` (the launcher) validates its flags, writes ``OUT/config.json`` and runs
``python -m torch.distributed.run ... -m superneurons.train.launch OUT/config.json``; each rank
then joins the process group (gloo on CPU, NCCL on CUDA) and calls
:func:`superneurons.train.loop.train`. Single node by default (c10d rendezvous on a free
localhost port); ``--nnodes/--node-rank/--rdzv-endpoint`` or ``--master-addr/--master-port``
pass through for several machines.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from superneurons.errors import ConfigError

__all__ = [
    "Launch",
    "init_distributed",
    "main",
    "run_torchrun",
    "torchrun_command",
    "under_torchrun",
]

logger = logging.getLogger("superneurons.train")

# NOTE: a rank that waits longer than this on a collective fails instead of hanging forever.
COLLECTIVE_TIMEOUT_S = 300


@dataclass(frozen=True)
class Launch:
    """How many processes, on how many machines, meeting where."""

    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # host:port of the c10d rendezvous
    master_addr: str | None = None  # static rendezvous instead (with master_port)
    master_port: int = 29500

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {self.nproc}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank must be in [0, --nnodes), got {self.node_rank} of {self.nnodes}"
            )
        if self.nnodes > 1 and self.rdzv_endpoint is None and self.master_addr is None:
            raise ConfigError("several nodes need --rdzv-endpoint HOST:PORT or --master-addr")


def under_torchrun() -> bool:
    """True inside a rank started by torchrun (it sets these variables)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (the one helper for local ranks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_command(launch: Launch, config_path: Path) -> list[str]:
    """The torchrun command line that runs every rank of this node on ``config_path``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(launch.nproc)]
    command += ["--nnodes", str(launch.nnodes), "--node-rank", str(launch.node_rank)]
    if launch.master_addr is not None:
        command += ["--master-addr", launch.master_addr, "--master-port", str(launch.master_port)]
    else:
        endpoint = launch.rdzv_endpoint or f"localhost:{free_port()}"
        command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    return [*command, "-m", "superneurons.train.launch", str(config_path)]


def run_torchrun(launch: Launch, config_path: Path) -> int:
    """Run the ranks of this node; their exit status (0 when all succeeded)."""
    command = torchrun_command(launch, config_path)
    logger.info("launching: %s", " ".join(command))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(command, env=env, check=False).returncode


def init_distributed(backend: str) -> torch.device:
    """Join the process group torchrun prepared; returns this rank's device.

    ``backend="auto"``: NCCL when CUDA is available, else gloo.
    """
    use_cuda = torch.cuda.is_available() and backend in ("auto", "nccl")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--backend nccl needs CUDA devices; use --backend gloo on CPU")
    chosen = "nccl" if use_cuda else "gloo"
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(chosen, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return device


def main(argv: Sequence[str] | None = None) -> int:
    """Rank entry point: ``python -m superneurons.train.launch OUT/config.json``."""
    from superneurons.train.config import TrainConfig
    from superneurons.train.loop import train

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m superneurons.train.launch OUT/config.json", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        train(TrainConfig.from_json(Path(args[0]).read_text(encoding="utf-8")))
    except ConfigError as exc:
        print(f"superneurons: error (rank {os.environ.get('RANK')}): {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
