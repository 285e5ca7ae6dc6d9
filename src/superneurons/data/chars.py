"""A character tokenizer and a corpus of word texts, both built here (no downloads): what a
causal-LM run needs when only the model's shape matters (the demo's TRL part, the adapter
benchmarks). The model's vocabulary may be far wider than the tokenizer's few ids: the head's
width is the model's, whatever the tokenizer uses."""

from __future__ import annotations

import string
from typing import Any

import torch

__all__ = ["CHARACTERS", "SPECIAL_TOKENS", "WORDS", "char_tokenizer", "word_texts"]

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")  # ids 0-3
CHARACTERS = "".join(sorted(set(string.ascii_letters + string.digits + " .,:;!?-'")))
WORDS = ("the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "sun", "is", "up")


def char_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` with one id per character of :data:`CHARACTERS` after the
    special tokens (pad 0, eos 1, bos 2, unk 3)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *CHARACTERS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
        unk_token="<unk>",
    )  # fmt: skip


def word_texts(count: int, *, chars: int, words_per_text: int, seed: int = 0) -> list[str]:
    """``count`` texts of exactly ``chars`` characters: a three-digit index, then
    ``words_per_text`` words of :data:`WORDS` drawn by a generator seeded with ``seed``, cut or
    padded with ``.`` (one length: every batch has one shape)."""
    if count < 1 or chars < 1 or words_per_text < 1:
        raise ValueError(
            f"count, chars and words_per_text must be positive (got {count}, {chars}, "
            f"{words_per_text})"
        )
    generator = torch.Generator().manual_seed(seed)
    texts = []
    for i in range(count):
        picks = torch.randint(0, len(WORDS), (words_per_text,), generator=generator).tolist()
        text = f"{i:03d} " + " ".join(WORDS[k] for k in picks)
        texts.append(text[:chars].ljust(chars, "."))
    return texts
