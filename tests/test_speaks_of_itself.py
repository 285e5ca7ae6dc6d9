"""The project speaks only of itself: no names of stretches of work, no issue numbers, no notes
that are not in the repository.

A reader of the code, the README, the docs or a benchmark result can open everything they cite:
papers, PyTorch issues (``pytorch#NNNN``), datasheets, or the project's own files. Labels of how
the work was organised ("session 3", a branch name such as "h4speed", "issue 9"), who did it
("helpers at work", "measured by the lead", "the brief"), a JSON key naming the stretch of work
(``"session"``) instead of the date, machine or command, and references to notes outside the
repository mean nothing to them. Results describe the run: machine, versions, command, a date.
Folder and file names say what they hold (machine, date, configuration), not who made them when
or whom they answer (``ANSWER.md``). Reads text only; runs in well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCOPE = ("src", "docs", "benchmarks", "examples", "tests", "README.md", "pyproject.toml")
TEXT = {".py", ".md", ".json", ".jsonl", ".txt", ".toml", ".cfg", ".sh", ".yml", ".yaml"}
# A word and a number naming a stretch of work ("session 3", "run 9", "wave2"), not a quantity
# ("runs 0.46 s"); a work branch ("h4speed"); an issue number; notes outside the repository.
_NOUN = r"(?:session|wave|sprint|iteration|run)"
FORBIDDEN = {
    "a work-diary label": re.compile(rf"\b{_NOUN}s?[ _-]?\d+[a-z]?\b(?![.,]\d)", re.IGNORECASE),
    "a work-branch name": re.compile(r"\bh\d+[a-z]{2,}\b"),
    "an issue number": re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE),
    "notes outside the repository": re.compile(
        r"(?<![A-Z_])CONTEXT(?![A-Z_])|\.\./shared|\b(?:STYLE|TEAM)\.md\b"
    ),
    "a key naming the stretch of work": re.compile(r'"(?:session|wave|sprint)s?"\s*:', re.I),
    "a stretch of work": re.compile(
        r"\b(?:this|that|last|previous|next|each|every|our|the) session\b|\bthis stop\b",
        re.IGNORECASE,
    ),
    "who did the work": re.compile(
        r"\bhelpers? at work\b|\bother (?:helpers|engineers)\b|\bengineers'? jobs\b"
        r"|\bthe lead(?:'s)?\b|\b(?:the|task) brief\b|\bbrief's\b",
        re.IGNORECASE,
    ),
    "how the work was merged": re.compile(
        r"\bthe merged code\b|\bafter merging the\b|\bworkstreams?\b", re.IGNORECASE
    ),
    "a reply in a conversation": re.compile(
        r"\b(?:ANSWER|REPLY)\.md\b|\b(?:our|the) previous answer\b", re.IGNORECASE
    ),
}
THIS = Path(__file__).resolve()


def _files() -> list[Path]:
    found: list[Path] = []
    for name in SCOPE:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        found += [p for p in candidates if p.is_file() and p.suffix in TEXT and p != THIS]
    return found


def _where(path: Path, text: str) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}: {what} "
        f"{match.group(0)!r}"
        for what, pattern in FORBIDDEN.items()
        for match in pattern.finditer(text)
    ]


def test_no_file_speaks_of_how_the_work_was_organised() -> None:
    found = [line for path in _files() for line in _where(path, path.read_text("utf-8"))]
    assert not found, "say what it is, or cite what a reader can open:\n" + "\n".join(found)


def test_no_folder_or_file_is_named_after_the_work() -> None:
    named = [
        f"{path.relative_to(ROOT)}: {what}"
        for name in SCOPE
        for path in (ROOT / name).rglob("*")
        for what, pattern in FORBIDDEN.items()
        if pattern.search(path.name)
    ]
    assert not named, "name it by what it holds (machine, date, configuration):\n" + "\n".join(
        named
    )


@pytest.mark.parametrize(
    ("text", "flagged"),
    [
        ("measured in session 4", True),
        ("see run9/ and Run 7", True),
        ("the h4speed branch", True),
        ("issue 11 item 3", True),
        ("(CONTEXT.md section 6)", True),
        ('   "session": "2026-11-22 20:13-20:30 UTC"', True),
        ("no GPU in this session", True),
        ("load ~4, three helpers at work", True),
        ("the judged table is re-run quiet by the lead", True),
        ("The brief's bar was parity", True),
        ("main after merging the 2026-11-23 work", True),
        ("see benchmarks/results/codecs/ANSWER.md", True),
        ("other engineers' jobs beside it", True),
        ("the ResNet runs 0.459 s", False),
        ("stage 3 of the ResNet, an H100 at 54.6 GB/s h2d", False),
        ("pytorch#53050 and _GLOBAL_DEVICE_CONTEXT", False),
        ('   "time_utc": "2026-11-22T20:13Z-20:30Z"', False),
        ("a ``torch.profiler`` session recording the allocator", False),
        ("the one helper for local ranks; four codes are merged in two steps", False),
        ("as Vogels et al. lead one to expect", False),
    ],
)
def test_the_patterns_mean_what_they_say(text: str, flagged: bool) -> None:
    assert bool(_where(ROOT / "x", text)) == flagged
