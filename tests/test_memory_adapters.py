"""``plan --lora`` / ``--quantize``: the flags' grammar (bad values are one line, exit 2),
bitsandbytes' storage formulae against real bitsandbytes modules, the fake model against PEFT's
own (the same parameters, dtypes and trainable flags), the JSON keys added only with adapters,
and the searches' options (past the positions, extrapolated in depth).

The steps against a real CPU step are in ``tests/test_memory_llm.py``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from superneurons.cli import main
from superneurons.commands.plan import _print_floors as print_floors
from superneurons.errors import ConfigError
from superneurons.memory.sizing.adapters import LoraSpec, QuantSpec, parse_lora, parse_quantize
from superneurons.memory.sizing.depth_fit import extrapolated, with_layers
from superneurons.memory.sizing.quantized import int8_storage_bytes, nf4_storage_bytes

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _tiny_llama(**overrides: int) -> object:
    fields = dict(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=172, vocab_size=512, max_position_embeddings=128,
    )  # fmt: skip
    fields.update(overrides)
    return transformers.LlamaConfig(use_cache=False, **fields)


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    _tiny_llama().to_json_file(str(path))  # type: ignore[attr-defined]
    return path


def test_specs_parse_once_and_print_back() -> None:
    lora = parse_lora("r=32,alpha=64,targets=q_proj,v_proj,dtype=base")
    assert lora == LoraSpec(r=32, alpha=64, targets=("q_proj", "v_proj"), dtype="base")
    assert lora.target_modules == ["q_proj", "v_proj"]
    assert parse_lora(lora.spec) == lora
    assert parse_lora("r=8").target_modules == "all-linear"
    quant = parse_quantize("nf4,double_quant=false,blocksize=128")
    assert quant == QuantSpec("nf4", double_quant=False, blocksize=128)
    assert parse_quantize(quant.spec) == quant
    assert parse_quantize("INT8") == QuantSpec("int8")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("r=0", "r must be >= 1"),
        ("rank=8", "no key 'rank': use r, alpha"),
        ("r=8,dtype=fp16", "dtype must be one of fp32, base"),
        ("r=eight", "must be an integer"),
        ("r=8,dropout=1.5", "dropout must be in [0, 1)"),
        ("r=8,r=16", "sets 'r' twice"),
        ("targets=all-linear,q_proj", "stands alone"),
        ("v_proj", "is not KEY=VALUE"),
    ],
)
def test_bad_lora_values_raise_saying_what_is_allowed(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match="--lora") as caught:
        parse_lora(text)
    assert says in str(caught.value)


def _error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["plan", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if not line.startswith("[plan] ")]  # progress lines
    assert len(errors) == 1 and errors[0].startswith("superneurons: error: "), lines
    return errors[0]


def test_bad_flags_are_one_line_exit_2(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = ["--model", f"hf:{config_path}", "--seq-len", "64", "--device-preset", "cpu"]
    assert "r must be >= 1" in _error(capsys, *model, "--lora", "r=0")
    assert "nf4, int8" in _error(capsys, *model, "--lora", "r=8", "--quantize", "nf5")
    assert "blocksize must be one of 32, 64" in _error(
        capsys, *model, "--lora", "r=8", "--quantize", "nf4,blocksize=100"
    )
    assert "int8 takes no options" in _error(
        capsys, *model, "--lora", "r=8", "--quantize", "int8,blocksize=128"
    )
    assert "--quantize needs --lora" in _error(capsys, *model, "--quantize", "nf4")
    assert "apply to --model hf:" in _error(capsys, "--model", "resnet50", "--lora", "r=8")
    # a target the model does not have: the layers it has are named
    message = _error(capsys, *model, "--budget", "1GiB", "--lora", "r=8,targets=c_attn")
    assert "q_proj" in message and "c_attn" in message
    # searches' options: depth fits only for searches; positions past a table cannot run
    assert "--max-seq-len" in _error(capsys, *model, "--fit-depth")
    assert "--beyond-positions" in _error(capsys, *model[:2], "--seq-len", "256")
    gpt2 = config_path.parent / "gpt2.json"
    transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128).to_json_file(str(gpt2))
    message = _error(
        capsys, "--model", f"hf:{gpt2}", "--max-seq-len", "--beyond-positions",
        "--strategy", "eager", "--device-preset", "cpu", "--budget", "1GiB",
    )  # fmt: skip
    assert "table of 128 rows" in message
    message = _error(
        capsys, "--model", f"hf:{gpt2}", "--seq-len", "256", "--beyond-positions",
        "--device-preset", "cpu", "--budget", "1GiB",
    )  # fmt: skip
    assert "table of 128 rows" in message


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@pytest.mark.parametrize("shape", [(64, 96), (172, 64), (33, 17)])
@pytest.mark.parametrize(("double_quant", "blocksize"), [(True, 64), (False, 64), (True, 128)])
def test_nf4_storage_formula_equals_bitsandbytes(
    shape: tuple[int, int], double_quant: bool, blocksize: int
) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    packed = bnb.nn.Params4bit(
        weight, requires_grad=False, blocksize=blocksize, compress_statistics=double_quant,
        quant_type="nf4",
    ).to("cpu")  # fmt: skip
    state = packed.quant_state
    held = [packed.data, state.absmax, state.code]
    if double_quant:
        held += [state.offset, state.state2.absmax, state.state2.code]
    expected = nf4_storage_bytes(
        out_features, in_features, double_quant=double_quant, blocksize=blocksize
    )
    assert _storage_bytes(held) == expected
    # the fake stand-in holds exactly those bytes
    from torch._subclasses.fake_tensor import FakeTensorMode

    from superneurons.memory.sizing.quantized import quantized_linear

    with FakeTensorMode():
        linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
        layer = quantized_linear(
            linear, "nf4", double_quant=double_quant, blocksize=blocksize,
            compute=torch.bfloat16, target_device="cuda",
        )  # fmt: skip
    assert isinstance(layer, bnb.nn.Linear4bit)  # so PEFT wraps it in lora.bnb.Linear4bit
    assert sum(p.untyped_storage().nbytes() for p in layer.parameters()) == expected


@pytest.mark.parametrize("shape", [(64, 96), (33, 17)])
def test_int8_storage_formula_equals_bitsandbytes(shape: tuple[int, int]) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    layer = bnb.nn.Linear8bitLt(
        in_features, out_features, bias=False, has_fp16_weights=False, threshold=0.0
    )
    layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    layer = layer.to("cpu")
    held = [layer.weight.data, layer.weight.SCB]
    assert _storage_bytes(held) == int8_storage_bytes(out_features, in_features)
    assert int8_storage_bytes(4096, 4096) == 4096 * 4096 + 4 * 4096


def test_nf4_formula_at_llama_shapes() -> None:
    """Llama-3.1-8B's gate projection (14336 x 4096): half a byte per weight, plus one byte
    per 64 weights of absmax, plus the second level (4 bytes per 256 blocks) and constants."""
    n = 14336 * 4096
    blocks = n // 64
    expected = n // 2 + blocks + 4 * math.ceil(blocks / 256) + 4 + 1024 + 64
    assert nf4_storage_bytes(14336, 4096) == expected
    assert nf4_storage_bytes(14336, 4096, double_quant=False) == n // 2 + 4 * blocks + 64


@pytest.mark.parametrize("dtype", ["fp32", "base"])
def test_fake_model_has_peft_s_parameters(dtype: str) -> None:
    """The fake adapted model: the same parameter names, shapes, dtypes and trainable flags
    as ``get_peft_model(...).base_model.model`` on a real bf16 model."""
    from superneurons.memory.sizing.llm import LMStep, _build, _transformers

    config = _tiny_llama()
    lora = parse_lora(f"r=4,targets=q_proj,v_proj,down_proj,dtype={dtype}")
    step = LMStep(seq_len=16, dtype="bf16", lora=lora)
    fake, _ = _build(_transformers(), config, step)
    real = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    wrapped = peft.get_peft_model(
        real,
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]),
        autocast_adapter_dtype=dtype == "fp32",
    )

    def signature(model: torch.nn.Module) -> dict[str, tuple]:
        return {n: (tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()}

    assert signature(fake) == signature(wrapped.base_model.model)
    adapters = {v[1] for n, v in signature(fake).items() if "lora_" in n}
    assert adapters == {torch.float32 if dtype == "fp32" else torch.bfloat16}


def test_json_keys_are_added_only_with_adapters(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["plan", "--json", "--model", f"hf:{config_path}", "--seq-len", "64"]
    base += ["--device-preset", "cpu", "--budget", "1GiB"]
    added = {"adapter", "quantize", "trainable_params", "trainable_bytes", "frozen_bytes"}
    assert main(base) == 0
    full = json.loads(capsys.readouterr().out)
    assert not added & set(full)
    assert main([*base, "--lora", "r=8"]) == 0
    lora = json.loads(capsys.readouterr().out)
    assert set(lora) == set(full) | added
    assert lora["quantize"] is None and lora["adapter"]["r"] == 8
    # 7 linear layers a block, 2 blocks: r (in + out) each, fp32
    config = _tiny_llama()
    h, kv, m = 64, 2 * 64 // 4, 172
    per_block = 8 * ((h + h) * 2 + (h + kv) * 2 + (h + m) * 3)
    assert lora["trainable_params"] == config.num_hidden_layers * per_block
    assert lora["trainable_bytes"] == 4 * lora["trainable_params"]
    # the frozen base: every parameter of the full fine-tune, now without gradients
    base = transformers.AutoModelForCausalLM.from_config(config)
    assert lora["frozen_bytes"] == sum(p.numel() * p.element_size() for p in base.parameters())
    assert lora["eager_peak_bytes"] < full["eager_peak_bytes"]


def test_one_plan_past_the_positions_is_the_plan_of_a_longer_configuration(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # rotary positions are computed, so memory does not depend on max_position_embeddings:
    # 256 tokens past a configuration of 128 plan exactly as a configuration of 256
    longer = config_path.parent / "longer.json"
    _tiny_llama(max_position_embeddings=256).to_json_file(str(longer))  # type: ignore[attr-defined]
    flags = ["--seq-len", "256", "--device-preset", "cpu", "--budget", "1GiB", "--lora", "r=8"]
    flags += ["--json"]
    assert main(["plan", "--model", f"hf:{config_path}", *flags, "--beyond-positions"]) == 0
    past = json.loads(capsys.readouterr().out)
    assert main(["plan", "--model", f"hf:{longer}", *flags]) == 0
    within = json.loads(capsys.readouterr().out)
    assert past["beyond_positions"] is True and "beyond_positions" not in within
    assert past["seq_len"] == 256 and past["max_positions"] == 128
    assert past["strategies"] == within["strategies"]
    assert past["predicted_peak_bytes"] == within["predicted_peak_bytes"]
    print_floors(past)  # the text report says so
    assert "past the configuration's 128 positions" in capsys.readouterr().out


def test_a_plan_says_on_stderr_as_each_phase_ends(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a 70B plan profiles for minutes: each phase's end is a line with its time
    flags = ["--device-preset", "cpu", "--budget", "1GiB", "--lora", "r=8", "--json"]
    assert main(["plan", "--model", f"hf:{config_path}", "--seq-len", "64", *flags]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)  # stdout holds the record alone
    lines = captured.err.strip().splitlines()
    assert all(line.startswith("[plan] ") for line in lines), lines
    phases = [line.removeprefix("[plan] ") for line in lines]
    assert phases[0].startswith("profiling hf:") and len(phases) == 4, phases
    assert re.fullmatch(r"profiled the step: \d+ events in \d+\.\d s", phases[1])
    assert re.fullmatch(r"profiled the step below the largest layer in \d+\.\d s", phases[2])
    assert re.fullmatch(r"searched every strategy's floor in \d+\.\d s", phases[3])


def test_depth_extrapolation_is_the_line_through_the_probes() -> None:
    calls: list[int] = []

    def peaks_at(layers: int) -> dict[str, int]:
        calls.append(layers)
        return {"offload": 1000 + 10 * layers, "eager": 500 + 100 * layers}

    assert extrapolated(peaks_at, 80) == {"offload": 1800, "eager": 8500}
    assert calls == [4, 8]
    assert extrapolated(peaks_at, 6) == {"offload": 1060, "eager": 1100}  # profiled directly
    qwen = transformers.Qwen2Config(num_hidden_layers=28)
    shallow = with_layers(qwen, 4)
    assert shallow.num_hidden_layers == 4 and len(shallow.layer_types) == 4
    assert qwen.num_hidden_layers == 28  # a copy
