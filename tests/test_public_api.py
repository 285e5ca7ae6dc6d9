"""The public surface is explicit and frozen: changing it must change this test."""

from __future__ import annotations

import superneurons
import superneurons.compress
import superneurons.memory
import superneurons.train

TOP_LEVEL = {
    "InfeasibleBudgetError",
    "Plan",
    "Profile",
    "apply_plan",
    "make_plan",
    "profile_step",
    "Codec",
    "CompressionState",
    "DeferredCompression",
    "ErrorFeedback",
    "Payload",
    "parse_spec",
    "register_compression",
    "exit_rank",
    "ConfigError",
    "__version__",
    "format_bytes",
    "parse_bytes",
}


def test_top_level_surface_is_frozen() -> None:
    assert set(superneurons.__all__) == TOP_LEVEL
    for name in superneurons.__all__:
        assert hasattr(superneurons, name), name


# How a user's own distributed script joins the group torchrun prepared and leaves it.
TRAIN = {"TrainConfig", "exit_rank", "init_distributed", "train"}


def test_train_surface_is_frozen() -> None:
    assert set(superneurons.train.__all__) == TRAIN
    assert superneurons.exit_rank is superneurons.train.exit_rank


def test_subpackage_all_names_exist() -> None:
    for package in (superneurons.compress, superneurons.memory, superneurons.train):
        assert len(package.__all__) == len(set(package.__all__))
        for name in package.__all__:
            assert hasattr(package, name), f"{package.__name__}.{name}"


def test_every_codec_name_is_exported_as_a_class() -> None:
    for name, cls in superneurons.compress.CODECS.items():
        assert name == cls.NAME
        assert cls.__name__ in superneurons.compress.__all__
