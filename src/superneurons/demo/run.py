"""``superneurons demo``: train a real model twice on 2 local ranks — dense DDP, then
superneurons (a device-memory budget plus FFT gradient compression with error feedback) — and
write a report with plots.

The two runs are ordinary ``superneurons train`` runs (torchrun, gloo on CPU / NCCL on CUDA);
the memory comparison measures one step of the same model eager and under the plan the
``--budget`` run executes.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from superneurons.errors import ConfigError

__all__ = ["DemoConfig", "run_demo"]

logger = logging.getLogger("superneurons.demo")


@dataclass(frozen=True)
class DemoConfig:
    """What the demo trains and how.

    Attributes:
        out_dir: where the runs and ``report.md`` go.
        model / data: a (model, dataset) pair the trainer knows.
        nproc: local ranks (torchrun).
        epochs: passes over the training set per run.
        batch_size: per rank.
        compress: the codec spec of the superneurons run (error feedback on).
        budget_fraction: the memory budget as a fraction of eager's measured peak; raised to
            the planner's minimum (with a warning) if below it.
        limit_steps: stop each run after this many steps (tests); None = full epochs.
        data_dir: dataset directory (default: the trainer's).
    """

    out_dir: Path = Path("runs/demo")
    model: str = "resnet"
    data: str = "fashion-mnist"
    nproc: int = 2
    epochs: int = 1
    batch_size: int = 64
    compress: str = "fft"
    budget_fraction: float = 0.5
    limit_steps: int | None = None
    data_dir: str | None = None
    extra_train_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.nproc < 1 or self.epochs < 1 or self.batch_size < 1:
            raise ConfigError("--nproc, --epochs and --batch-size must be >= 1")
        if not 0.0 < self.budget_fraction <= 1.0:
            raise ConfigError(f"--budget-fraction must be in (0, 1], got {self.budget_fraction}")
        if self.limit_steps is not None and self.limit_steps < 1:
            raise ConfigError("--limit-steps must be >= 1")


Progress = Callable[[str], None]


def _memory_comparison(config: DemoConfig, progress: Progress) -> dict:
    """Measure eager vs planned memory of one step; returns the comparison as a dict."""
    from superneurons.demo.memory import compare_memory
    from superneurons.train.task import build_task

    torch.manual_seed(0)
    task = build_task(config.model, config.data, data_dir=config.data_dir, block_size=128)
    loader = torch.utils.data.DataLoader(task.train_set, batch_size=config.batch_size)
    inputs, targets = next(iter(loader))

    def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def on_minimum(fraction: float) -> None:
        progress(
            f"      {config.budget_fraction:.0%} of eager's peak is below the planner's minimum "
            f"for this model and batch; using the minimum, {fraction:.0%} of eager's peak"
        )

    comparison = compare_memory(
        task.model,
        make_optimizer,
        inputs,
        targets,
        task.loss_fn,
        budget_fraction=config.budget_fraction,
        on_minimum=on_minimum,
    )
    return comparison.as_dict()


def _train(config: DemoConfig, name: str, args: list[str]) -> Path:
    out = config.out_dir / name
    command = [
        sys.executable,
        "-m",
        "superneurons.cli",
        "train",
        "--model",
        config.model,
        "--data",
        config.data,
        "--nproc",
        str(config.nproc),
        "--epochs",
        str(config.epochs),
        "--batch-size",
        str(config.batch_size),
        "--out",
        str(out),
        *args,
        *config.extra_train_args,
    ]
    if config.limit_steps is not None:
        command += ["--limit-steps", str(config.limit_steps)]
    if config.data_dir is not None:
        command += ["--data-dir", config.data_dir]
    logger.info("running: %s", " ".join(command))
    # stderr passes through: rank 0's progress bar shows while it runs.
    result = subprocess.run(command, stdout=subprocess.DEVNULL, check=False)
    if result.returncode != 0:
        raise ConfigError(f"the {name} run failed (exit status {result.returncode}); see above")
    return out


def run_demo(config: DemoConfig, *, progress: Progress = lambda _msg: None) -> Path:
    """Run the demo and return the path of ``report.md``."""
    from superneurons.demo.report import write_report

    config.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    progress("[1/4] measuring one step's device memory, eager and under a plan")
    memory = _memory_comparison(config, progress)
    (config.out_dir / "memory.json").write_text(json.dumps(memory, indent=2) + "\n")
    budget = memory["budget_bytes"]
    progress(
        f"      eager peak {memory['eager_peak_bytes'] / 2**20:.1f} MiB, budget "
        f"{budget / 2**20:.1f} MiB, planned peak {memory['planned_peak_bytes'] / 2**20:.1f} MiB"
    )
    progress(f"[2/4] training with dense DDP on {config.nproc} ranks")
    dense = _train(config, "dense", ["--compress", "dense"])
    progress(f"[3/4] training with superneurons: --budget {budget} --compress {config.compress}")
    ours = _train(config, "superneurons", ["--compress", config.compress, "--budget", str(budget)])
    progress("[4/4] writing the report")
    report = write_report(
        config.out_dir,
        runs={"dense DDP": dense, "superneurons": ours},
        memory=memory,
        wall_s=time.perf_counter() - started,
    )
    return report
