"""Median before/after GB/s from repeated `bench codecs` runs: python summarise.py DIR RUNS
(DIR holds before1..N and after1..N, each with speed-cpu.json)."""

import json, statistics, sys
R = sys.argv[1]; n = int(sys.argv[2]) if len(sys.argv) > 2 else 3
rows = {}
for v in ("before", "after"):
    for i in range(1, n + 1):
        data = json.load(open(f"{R}/{v}{i}/speed-cpu.json"))
        recs = data["records"] if isinstance(data, dict) and "records" in data else data
        for r in recs:
            rows.setdefault((r["codec"], r["size_mib"], v), []).append(r)
for key in sorted(rows, key=lambda k: (k[1], k[0], k[2] != "before")):
    vals = rows[key]
    f = lambda name: [x[name] for x in vals]
    e, d = f("encode_gbps_cpu_time"), f("decode_gbps_cpu_time")
    print(f"{key[0]:9s} {key[1]:5.0f}MiB {key[2]:6s} enc cpu {' '.join('%.3f' % x for x in e)} med {statistics.median(e):.3f} | dec cpu {' '.join('%.3f' % x for x in d)} med {statistics.median(d):.3f} | wall med enc {statistics.median(f('encode_gbps')):.3f} dec {statistics.median(f('decode_gbps')):.3f}")
