"""Run under torchrun by the ``two_rank_runs`` fixture (tests/conftest.py): the two-rank runs of
test_integrations_host_step, test_integrations_hf and test_integrations_trl in one launch, so
that each rank imports transformers, TRL and PEFT once (about 10 s of CPU per process) instead
of once per test.

Parts, in this order: hf_resume_run's Trainer runs (transformers alone), host_step_run's
loops (its TRL runs, then its Accelerate loop, as that script runs them), trl_run's LoRA runs,
trl_run's matrix (its nudged rank last). Each trainer starts from fresh Accelerate state
(``TrainingArguments`` resets it), so a part sees what it would see alone. Each part writes
``<out>/<part>/rank<R>.json`` as it ends; a part that raises ends the launch (the later parts'
files are then missing).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf_resume_run  # noqa: E402
import host_step_run  # noqa: E402
import trl_run  # noqa: E402

PARTS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "hf-resume": hf_resume_run.records,
    "host-step": host_step_run.records,
    "trl-peft": lambda out: trl_run.records(out, peft=True),
    "trl": trl_run.records,
}


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    rank = int(os.environ.get("RANK", "0"))
    for part, records in PARTS.items():
        folder = out / part
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{rank}.json").write_text(json.dumps(records(folder)) + "\n")


if __name__ == "__main__":
    from superneurons.train.rank import exit_rank

    main()
    exit_rank(0)  # barrier, destroy, exit without racing gloo's threads (pytorch#179291)
