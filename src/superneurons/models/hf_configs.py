"""Hugging Face causal-LM configurations shipped by name: shapes only, never weights.

``superneurons plan --model hf:NAME`` plans one of these without downloading anything; ``hf:PATH``
reads any ``config.json`` instead. Each entry is the ``config.json`` of the public model, as
published on the Hugging Face Hub (``source``), reduced to the hyper-parameters that decide
memory: widths, depths, heads, vocabulary, positions, tying, rotary settings, dropout.
``transformers.AutoConfig.for_model(**config)`` builds the configuration from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["HF_CONFIGS", "HFConfig"]


@dataclass(frozen=True)
class HFConfig:
    """A shipped configuration: ``config`` is the model's ``config.json`` (``model_type``
    included) and ``source`` the page it was read from."""

    source: str
    config: dict[str, Any] = field(default_factory=dict)


# NOTE: literal table; copy the fields from the linked config.json when adding one.
HF_CONFIGS: dict[str, HFConfig] = {
    "llama-3-8b": HFConfig(
        "https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json",
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
        },
    ),
    # Unsloth's long-context anchors (QLoRA); 131072 positions through llama3 rope scaling
    "llama-3.1-8b": HFConfig(
        "https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json",
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "factor": 8.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
        },
    ),
    "llama-3.3-70b": HFConfig(
        "https://huggingface.co/meta-llama/Llama-3.3-70B-Instruct/blob/main/config.json",
        {
            "model_type": "llama",
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "factor": 8.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009],
        },
    ),
    "llama-3.2-1b": HFConfig(
        "https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json",
        {
            "model_type": "llama",
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "factor": 32.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": True,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
        },
    ),
    "qwen2.5-7b": HFConfig(
        "https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json",
        {
            "model_type": "qwen2",
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "sliding_window": 131072,
            "use_sliding_window": False,
            "max_window_layers": 28,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "bos_token_id": 151643,
            "eos_token_id": 151643,
        },
    ),
    "gpt2": HFConfig(
        "https://huggingface.co/openai-community/gpt2/blob/main/config.json",
        {
            "model_type": "gpt2",
            "n_embd": 768,
            "n_layer": 12,
            "n_head": 12,
            "n_positions": 1024,
            "n_ctx": 1024,
            "vocab_size": 50257,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "attn_pdrop": 0.1,
            "embd_pdrop": 0.1,
            "resid_pdrop": 0.1,
            "bos_token_id": 50256,
            "eos_token_id": 50256,
        },
    ),
}
