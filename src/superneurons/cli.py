"""The ``superneurons`` command line.

Each subcommand lives in its own module under :mod:`superneurons.commands` exposing
``HELP: str``, ``add_arguments(parser)`` and ``run(args) -> int``; this file only wires them
together. Bad input (a :class:`~superneurons.errors.ConfigError`) is one line on stderr and
exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

from superneurons.errors import ConfigError

__all__ = ["main"]

# NOTE: a literal table, not a registry: the whole CLI surface is visible here.
COMMANDS: dict[str, str] = {
    "demo": "superneurons.commands.demo",
    "train": "superneurons.commands.train",
    "plan": "superneurons.commands.plan",
}
BENCH_COMMANDS: dict[str, str] = {
    "codecs": "superneurons.commands.bench_codecs",
    "network": "superneurons.commands.bench_network",
    "memory": "superneurons.commands.bench_memory",
    "deeper": "superneurons.commands.bench_deeper",
    "convergence": "superneurons.commands.bench_convergence",
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad flags in one line with a hint, exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _load(module_path: str) -> ModuleType | None:
    try:
        return importlib.import_module(module_path)
    except ModuleNotFoundError as exc:
        if exc.name == module_path:  # command not shipped in this build
            return None
        raise


def _add_commands(subparsers: argparse._SubParsersAction, table: dict[str, str]) -> None:
    for name, module_path in table.items():
        module = _load(module_path)
        if module is None:
            continue
        sub = subparsers.add_parser(
            name,
            help=module.HELP,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="superneurons",
        description="Train networks that do not fit device memory, and train data-parallel "
        "over networks too slow for plain all-reduce.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=_Parser)
    _add_commands(commands, COMMANDS)
    bench = commands.add_parser("bench", help="benchmarks that write JSON, Markdown and a PNG")
    bench_commands = bench.add_subparsers(title="benchmarks", metavar="BENCH", parser_class=_Parser)
    _add_commands(bench_commands, BENCH_COMMANDS)
    bench.set_defaults(_run=lambda _args: _print_help(bench))
    parser.set_defaults(_run=lambda _args: _print_help(parser))
    return parser


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args._run(args) or 0)
    except ConfigError as exc:
        print(f"superneurons: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("superneurons: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
