"""Python's global random stream is left where it was by work that draws from it."""

from __future__ import annotations

import random

import pytest

from superneurons.randomness import python_random_kept


def test_the_stream_is_kept_around_draws_and_failures() -> None:
    random.seed(1234)
    expected = random.random()
    random.seed(1234)
    with python_random_kept():
        draws = [random.random() for _ in range(5)]
    assert random.random() == expected != draws[1]
    random.seed(1234)
    with pytest.raises(RuntimeError), python_random_kept():
        random.random()
        raise RuntimeError("the block failed")
    assert random.random() == expected
