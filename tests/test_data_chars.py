"""The character tokenizer and word texts built in code: one id per character, texts of one
length drawn reproducibly, bad sizes refused."""

from __future__ import annotations

import pytest

from superneurons.data.chars import CHARACTERS, SPECIAL_TOKENS, char_tokenizer, word_texts

pytest.importorskip("tokenizers")


def test_every_character_is_one_id_after_the_special_tokens() -> None:
    tok = char_tokenizer()
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARACTERS)
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    ids = tok("a cat")["input_ids"]
    assert ids == [len(SPECIAL_TOKENS) + CHARACTERS.index(c) for c in "a cat"]


def test_texts_have_one_length_and_repeat_for_a_seed() -> None:
    texts = word_texts(50, chars=30, words_per_text=12)
    assert len(texts) == 50 and {len(t) for t in texts} == {30}
    assert texts[7].startswith("007 ")
    assert texts == word_texts(50, chars=30, words_per_text=12)
    assert texts != word_texts(50, chars=30, words_per_text=12, seed=1)
    padded = word_texts(3, chars=40, words_per_text=1)  # shorter than chars: padded with dots
    assert all(t.endswith(".") and len(t) == 40 for t in padded)


@pytest.mark.parametrize("count,chars,words", [(0, 30, 12), (5, 0, 12), (5, 30, 0)])
def test_non_positive_sizes_are_refused(count: int, chars: int, words: int) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        word_texts(count, chars=chars, words_per_text=words)
