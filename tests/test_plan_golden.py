"""``superneurons plan --json`` prints byte for byte what the files in ``tests/golden/`` hold.

Each file is the command's output (named in ``CASES``) before ``memory/`` was laid out a folder
per feature and ``plan`` became one call; profiles on fake tensors and the planner are
deterministic, so any difference is a change of what the planner decides or reports. Regenerate
a file only for a deliberate change, with the command beside it, and say why in the commit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from superneurons.cli import main

GOLDEN = Path(__file__).resolve().parent / "golden"

CASES = {
    "plan_resnet50.json": ["--model", "resnet50"],
    "plan_gpt_batch8_adamw.json": ["--model", "gpt", "--batch", "8", "--optimizer", "adamw"],
}
LM_CASE = {
    "plan_llama-3-8b_seq512_bf16_adamw.json": [
        "--model",
        "hf:llama-3-8b",
        "--seq-len",
        "512",
        "--batch",
        "1",
        "--dtype",
        "bf16",
        "--optimizer",
        "adamw",
    ],
}


def _check(name: str, args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *args, "--json"]) == 0
    printed = capsys.readouterr().out
    golden = (GOLDEN / name).read_text(encoding="utf-8")
    assert printed == golden, f"plan {' '.join(args)} --json differs from tests/golden/{name}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_json_equals_its_golden_file(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    _check(name, CASES[name], capsys)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LM_CASE))
def test_causal_lm_plan_json_equals_its_golden_file(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    _check(name, LM_CASE[name], capsys)


def test_max_grad_norm_adds_keys_and_states_what_clipping_costs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json

    name = "plan_gpt_batch8_adamw.json"
    assert main(["plan", *CASES[name], "--max-grad-norm", "1.0", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    golden = json.loads((GOLDEN / name).read_text(encoding="utf-8"))
    assert set(golden) <= set(record)  # keys added, none renamed or removed
    assert record["max_grad_norm"] == 1.0 and record["plan"]["step"]["max_grad_norm"] == 1.0
    for strategy, floor in golden["strategies"].items():  # each floor, and what it cost
        cost = record["step_costs"][strategy]
        clipped = record["strategies"][strategy]
        assert clipped["min_budget_bytes"] - floor["min_budget_bytes"] == cost["device_bytes"]
    host = record["step_costs"]["offload+host-optimizer"]
    # the host optimizer: no device byte, a host copy of every gradient, its step exposed
    resident = record["strategies"]["offload+host-optimizer"]["resident_bytes"]
    assert host["device_bytes"] == 0 and host["host_bytes"] == resident
    assert host["overhead_s"] > 0
    for flags in (["--max-grad-norm", "-1"], ["--max-grad-norm", "1", "--max-batch"]):
        assert main(["plan", "--model", "gpt", *flags]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
