"""Median before/after GB/s of repeated `bench codecs` runs.

Usage: python summarise.py DIR RUNS (DIR holds before1..RUNS and after1..RUNS, each with the
speed-cpu.json that `superneurons bench codecs --device cpu` writes).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _records(path: Path) -> list[dict[str, Any]]:
    with path.open() as handle:
        data = json.load(handle)
    return data["records"] if isinstance(data, dict) and "records" in data else data


def main() -> None:
    root, runs = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3
    rows: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for version in ("before", "after"):
        for run in range(1, runs + 1):
            for record in _records(root / f"{version}{run}" / "speed-cpu.json"):
                key = (record["codec"], record["size_mib"], version)
                rows.setdefault(key, []).append(record)
    for key in sorted(rows, key=lambda k: (k[1], k[0], k[2] != "before")):
        columns = {
            name: [record[name] for record in rows[key]]
            for name in (
                "encode_gbps_cpu_time",
                "decode_gbps_cpu_time",
                "encode_gbps",
                "decode_gbps",
            )
        }
        enc, dec = columns["encode_gbps_cpu_time"], columns["decode_gbps_cpu_time"]
        print(
            f"{key[0]:9s} {key[1]:5.0f}MiB {key[2]:6s} "
            f"enc cpu {' '.join(f'{x:.3f}' for x in enc)} med {statistics.median(enc):.3f} | "
            f"dec cpu {' '.join(f'{x:.3f}' for x in dec)} med {statistics.median(dec):.3f} | "
            f"wall med enc {statistics.median(columns['encode_gbps']):.3f} "
            f"dec {statistics.median(columns['decode_gbps']):.3f}"
        )


if __name__ == "__main__":
    main()
