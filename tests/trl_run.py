"""The runs of test_integrations_trl: ``records`` in the test's process (one rank) or under
torchrun through two_rank_runs.py (two gloo ranks; also runnable alone as a script): TRL's
SFTTrainer with and without SuperNeuronsCallback(budget_fraction=0.6) for packing off/on x
fp32/bf16 (on one rank, the path without DDP, each value of each knob once: packed fp32 and
unpacked bf16; on two ranks the other two: unpacked fp32 and packed bf16); on two ranks also
compression stopped at step 2 and resumed into another output_dir, and a rank nudged before
the replica check. With ``--peft``: LoRA adapters through ``peft_config``, TRL alone and under
the callback, only. Writes rank<R>.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trl_support  # noqa: E402

COMPRESSION = "ef(topk:ratio=0.1)"
MATRIX = ((False, False), (False, True), (True, False), (True, True))  # (packing, bf16)
# NOTE: bf16 matmuls are ~10x slower than fp32 on CPUs without native bf16 (measured on the
# 2-core CI machine): packed bf16 is most of a one-rank matrix's time; one rank runs these two
ONE_RANK = ((True, False), (False, True))
# Two ranks run the other two: together the runs cover every (packing, bf16) pair once, and
# every value of each knob with and without DDP (every pair of the three factors' values).
TWO_RANKS = tuple(config for config in MATRIX if config not in ONE_RANK)


def _nudge_rank_one() -> Any:
    from transformers import TrainerCallback

    class _Nudge(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if args.process_index == 1:
                with torch.no_grad():
                    next(kw["model"].parameters()).view(-1)[0] += 1e-3

    return _Nudge()


def records(out: Path, *, peft: bool = False) -> dict[str, Any]:
    """This process's record (its rank's when under torchrun), as ``main`` writes it: the
    matrix of its world size, or with ``peft`` the LoRA runs."""
    from superneurons.errors import ReplicaMismatchError

    two = int(os.environ.get("WORLD_SIZE", "1")) > 1
    record: dict[str, Any] = {}
    if peft:  # LoRA adapters (peft_config), TRL alone and under a 0.6 budget
        kw: dict[str, Any] = {"packing": False, "bf16": False, "peft": True, "examples": 32}
        record["peft,eager"] = trl_support.run(out / "peft-eager", **kw)
        record["peft,planned"] = trl_support.run(
            out / "peft-planned", budget_fraction=0.6, meter=True, **kw
        )
        return record
    matrix = TWO_RANKS if two else ONE_RANK
    for packing, bf16 in matrix:
        name = f"packing={packing},bf16={bf16}"
        kw = {"packing": packing, "bf16": bf16}
        record[f"{name},eager"] = trl_support.run(out / "eager" / name, **kw)
        record[f"{name},planned"] = trl_support.run(
            out / "planned" / name, budget_fraction=0.6, meter=True, **kw
        )
    if two:
        kw = {"packing": False, "bf16": False, "budget_fraction": 0.6, "compression": COMPRESSION}
        record["compressed"] = trl_support.run(out / "a", **kw)
        trl_support.run(out / "b", save_steps=2, stop_at=2, **kw)
        checkpoint = out / "b" / "checkpoint-2"
        record["saved"] = sorted(p.name for p in checkpoint.glob("superneurons-*"))
        record["resumed_elsewhere"] = trl_support.run(out / "c", resume=checkpoint, **kw)
        try:
            trl_support.run(out / "d", checks=[_nudge_rank_one()], **kw)
            record["nudged"] = "no error"
        except ReplicaMismatchError as exc:
            record["nudged"] = str(exc)
    return record


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    rank = int(os.environ.get("RANK", "0"))
    record = records(out, peft="--peft" in sys.argv)
    (out / f"rank{rank}.json").write_text(json.dumps(record) + "\n")


if __name__ == "__main__":
    from superneurons.train.rank import exit_rank

    main()
    exit_rank(0)  # barrier, destroy, exit without racing gloo's threads (pytorch#179291)
