"""``superneurons plan --model hf:...`` below the largest layer: the CLI searches the profile with
the LM head + loss in chunks and the block MLPs over sequence pieces (``--below floor``, the
default) beside the plain one, and reports per strategy what that profile holds.

A tiny Llama whose vocabulary dwarfs its hidden size (so the head + loss binds), fake tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from superneurons.cli import main
from superneurons.memory.plan import SEARCH_STRATEGIES

transformers = pytest.importorskip("transformers")

SEQ = 512  # >= 2 pieces of seqchunk.MIN_PIECE_TOKENS, >= 2 head chunks


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=172, vocab_size=8192, max_position_embeddings=SEQ, use_cache=False,
    )  # fmt: skip
    path = tmp_path / "config.json"
    config.to_json_file(str(path))
    return path


def _plan(capsys: pytest.CaptureFixture[str], config_path: Path, *args: str) -> dict:
    command = ["plan", "--json", "--model", f"hf:{config_path}", "--seq-len", str(SEQ)]
    assert main([*command, "--budget", "1GiB", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_searches_the_chunked_profiles(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = _plan(capsys, config_path, "--below", "off")
    below = _plan(capsys, config_path)  # the default: --below floor
    assert below["below"] == "floor" and plain["below"] == "off"
    assert set(below["strategies"]) == set(plain["strategies"]) == set(SEARCH_STRATEGIES)
    for name, floor in below["strategies"].items():
        before = plain["strategies"][name]
        assert set(floor) >= set(before), name  # every key of the plain report kept
        assert floor["min_budget_bytes"] <= before["min_budget_bytes"], name
        assert sum(floor["breakdown"].values()) == floor["min_budget_bytes"], name
        assert before["head_chunk_tokens"] is None and before["mlp_pieces"] == 1
    host = below["strategies"]["offload+host-optimizer"]
    unchunked = plain["strategies"]["offload+host-optimizer"]
    assert host["min_budget_bytes"] < unchunked["min_budget_bytes"]
    assert host["head_chunk_tokens"] is not None and host["head_chunk_tokens"] < SEQ
    assert host["mlp_pieces"] >= 2
    assert host["head_loss_working_set_bytes"] < unchunked["head_loss_working_set_bytes"] / 2
    # the top level's bound is the floor strategy's own
    best = below["strategies"][below["floor_strategy"]]
    assert below["floor_bytes"] == best["min_budget_bytes"] == below["min_budget_bytes"]
    assert below["floor_over_largest_layer"] == best["floor_over_largest_layer"]


def test_a_budget_only_the_chunked_profile_meets_is_planned_with_it(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    below = _plan(capsys, config_path)
    floor = below["strategies"]["offload+host-optimizer"]["min_budget_bytes"]
    fitted = _plan(
        capsys, config_path, "--budget", str(floor), "--strategy", "offload+host-optimizer"
    )
    assert fitted["predicted_peak_bytes"] <= floor
    assert fitted["head_chunk_tokens"] is not None and fitted["plan"]["head"] is not None
    assert main(["plan", "--model", f"hf:{config_path}", "--seq-len", str(SEQ), "--below", "off",
                 "--budget", str(floor), "--strategy", "offload+host-optimizer"]) == 2  # fmt: skip
