"""Progress that suits its output: a live bar on a terminal, plain lines in a log.

A tqdm bar redraws itself with carriage returns, which a terminal turns into one moving line
but a log file or a CI console keeps as thousands of frames. So :func:`progress_bar` gives a
tqdm bar only when the stream is a terminal (and tqdm, an optional extra, is installed);
otherwise a :class:`LineProgress` that writes one plain line every ``interval_s`` seconds and a
last one when it closes — never a carriage return.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import IO, Any, Protocol

__all__ = ["LineProgress", "Progress", "progress_bar"]

# NOTE: often enough to see a run is alive, rare enough that a day-long log stays readable.
DEFAULT_INTERVAL_S = 10.0


class Progress(Protocol):
    """The subset of tqdm's interface the CLI and benchmarks use."""

    n: float

    def update(self, n: float = 1) -> Any: ...

    def set_postfix(self, **values: Any) -> None: ...

    def set_postfix_str(self, text: str = "") -> None: ...

    def refresh(self) -> Any: ...

    def close(self) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Any: ...


class LineProgress:
    """Progress as plain lines: ``epoch 1/2: 40/100 step (40%), 3.2 step/s, loss=0.512``.

    A line is written when ``interval_s`` has passed since the last one (checked on
    :meth:`update` and :meth:`refresh`) and when it closes, if anything happened since.
    """

    def __init__(
        self,
        total: float | None = None,
        *,
        desc: str = "",
        file: IO[str] | None = None,
        unit: str = "it",
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.n: float = 0
        self.interval_s = interval_s
        self._file = file if file is not None else sys.stderr
        self._clock = clock
        self._start_s = self._last_s = clock()
        self._written_n: float = 0
        self._postfix = ""
        self._closed = False

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        self.refresh()

    def set_postfix(self, **values: Any) -> None:
        self._postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def set_postfix_str(self, text: str = "") -> None:
        self._postfix = text

    def refresh(self) -> None:
        if self._clock() - self._last_s >= self.interval_s:
            self._write()

    def close(self) -> None:
        if not self._closed and self.n != self._written_n:
            self._write()
        self._closed = True

    def line(self) -> str:
        """The line as it would be written now."""
        done = f"{self.n:g}" if self.total is None else f"{self.n:g}/{self.total:g}"
        parts = [f"{done} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        elapsed_s = self._clock() - self._start_s
        if elapsed_s > 0 and self.n:
            parts.append(f"{self.n / elapsed_s:.3g} {self.unit}/s")
        if self._postfix:
            parts.append(self._postfix)
        prefix = f"{self.desc}: " if self.desc else ""
        return prefix + ", ".join(parts)

    def _write(self) -> None:
        self._file.write(self.line() + "\n")
        self._file.flush()
        self._last_s = self._clock()
        self._written_n = self.n


def _is_terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except (OSError, ValueError):  # a closed or detached stream
        return False


def progress_bar(
    total: float | None = None,
    *,
    desc: str = "",
    file: IO[str] | None = None,
    unit: str = "it",
    interval_s: float = DEFAULT_INTERVAL_S,
    leave: bool = True,
) -> Progress:
    """A tqdm bar on a terminal, a :class:`LineProgress` anywhere else (files, pipes, CI).

    ``file`` defaults to ``sys.stderr``, looked up when called (so redirection applies).
    """
    stream = file if file is not None else sys.stderr
    if _is_terminal(stream):
        try:
            from tqdm import tqdm
        except ImportError:  # tqdm is an optional extra: plain lines without it
            pass
        else:
            bar: Progress = tqdm(
                total=total, desc=desc, file=stream, unit=unit, leave=leave, dynamic_ncols=True
            )
            return bar
    return LineProgress(total, desc=desc, file=stream, unit=unit, interval_s=interval_s)
