"""One rank of ``superneurons train``: ``python -m superneurons.commands.rank OUT/config.json``.

torchrun runs this module in every rank it starts (see
:func:`superneurons.train.launch.torchrun_command`); it is not a subcommand. Bad input is one
line on stderr and exit status 2, like the CLI. The process ends through
:func:`superneurons.train.rank.exit_rank`, whatever happened (a traceback and status 1 for an
unexpected error).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from superneurons.errors import ConfigError

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    from superneurons.train.config import TrainConfig
    from superneurons.train.loop import train

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m superneurons.commands.rank OUT/config.json", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        train(TrainConfig.from_json(Path(args[0]).read_text(encoding="utf-8")))
    except ConfigError as exc:
        print(f"superneurons: error (rank {os.environ.get('RANK')}): {exc}", file=sys.stderr)
        return 2
    return 0


def _run_and_exit() -> None:
    from superneurons.train.rank import exit_rank

    try:
        status = main()
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except KeyboardInterrupt:
        status = 130
    except BaseException:  # noqa: BLE001 - shown, then the one way out of a rank
        traceback.print_exc()
        status = 1
    exit_rank(status)


if __name__ == "__main__":
    _run_and_exit()
