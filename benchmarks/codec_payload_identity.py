"""Payload and decode digests of every codec, to prove a change moved no byte.

A performance change to a codec (or the shared coding under them), or a move of the code, must
keep every payload byte-identical and every decode bit-identical. This script encodes a fixed
set of random and structured vectors with a fixed set of specs (stochastic codecs with a fixed
generator per case) and prints one SHA-256 per (spec, vector) of the payload bytes, of
``decode_sum`` over three payloads and of one ``decode``. Run it
against a reference source tree and the current one and compare::

    git archive <base> src | tar -x -C /tmp/base
    python benchmarks/codec_payload_identity.py --reference-src /tmp/base/src

(``--reference-src`` runs the digests twice, in two subprocesses with different
``PYTHONPATH``, and exits non-zero on any difference not in :data:`STATED_CHANGES`);
``--digests`` prints this tree's digests as JSON. One thread, CPU.

:data:`STATED_CHANGES` lists the cases a deliberate change of an algorithm moved, each with
why (``tests/test_codec_identity.py`` holds this tree to the same list).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

SPECS: tuple[str, ...] = (
    "fft",
    "fft:select=exact",
    "fft:index=bitmap",
    "fft:index=gap",
    "fft:bits=4",
    "fft:bits=16",
    "fft:bits=32",
    "fft:theta=0.5",
    "fft:theta=0.99",
    "fft:chunk=0",
    "fft:chunk=300",
    "fft:chunk=4096",
    "adaptive",
    "adaptive:select=exact",
    "adaptive:scope=chunk,header=fixed",
    "adaptive:header=fixed",
    "adaptive:choice=l1",
    "adaptive:margin=0.1",
    "adaptive:bases=spatial+dct",
    "adaptive:bases=fourier",
    "adaptive:bases=dct+fourier",
    "adaptive:index=bitmap",
    "adaptive:bits=32",
    "adaptive:bits=4",
    "adaptive:chunk=64",
    "ctopk",
    "ctopk:select=exact",
    "ctopk:theta=0.9",
    "ctopk:bits=4",
    "ctopk:bits=32",
    "topk",  # shares the sampled selection
    "topk:ratio=0.1,select=sampled",
    "identity",
    "fp16",
    "bf16",
    "rangefloat",
    "rangefloat:bits=4",
    "rangefloat:bits=16",
    "rangefloat:bits=32",
    "qsgd",
    "qsgd:levels=4,bucket=128",
    "terngrad",
    "terngrad:clip=1.0",
    "signsgd",
)


# (spec, vector) -> why its payload and decodes may differ from the tree before the change.
STATED_CHANGES: dict[tuple[str, str], str] = {
    ("fft:chunk=300", "spikes"): (
        "fft's sampled selection places its bracket from whole sampled rows in one pass "
        "(codecs/sparse/blocks.py) instead of a strided sample of the full spectrum; both keep "
        "the k bins of largest weighted power, and here two bins tie exactly at the k-th "
        "largest (a 300-value chunk holding one spike has a flat spectrum): each path keeps "
        "a different one of the two. The multiset of kept scores is the same."
    ),
}


def stated(key: str) -> bool:
    """Whether a digest key (``spec|vector|part``) is one :data:`STATED_CHANGES` may move."""
    spec, vector, _ = key.split("|")
    return (spec, vector) in STATED_CHANGES


def _vectors() -> dict[str, object]:
    import torch

    gen = torch.Generator().manual_seed(1234)
    n = 1 << 20
    t = torch.arange(n, dtype=torch.float32)
    spikes = torch.zeros(n)
    spikes[torch.randperm(n, generator=gen)[:5000]] = torch.randn(5000, generator=gen)
    blocks = torch.randn(n // 512, 1, generator=gen).expand(n // 512, 512).reshape(-1)
    with_nan = torch.randn(4099, generator=gen)
    with_nan[17] = float("nan")
    return {
        "randn_1M": torch.randn(n, generator=gen),
        "randn_100003": torch.randn(100003, generator=gen),
        "heavy_tail": torch.randn(n, generator=gen) ** 3,
        "sinusoids": torch.sin(t * 0.01) + 0.1 * torch.randn(n, generator=gen),
        "spikes": spikes,
        "blocks_plus_noise": blocks + 1e-3 * torch.randn(n, generator=gen),
        "ties": torch.ones(70001).mul_(0.5),
        "zeros": torch.zeros(8192),
        "tiny_scale": torch.randn(300000, generator=gen) * 1e-30,
        "small_7": torch.randn(7, generator=gen),
        "small_513": torch.randn(513, generator=gen),
        "with_nan": with_nan,
    }


def digests() -> dict[str, str]:
    """``{"spec|vector|payload": sha256, "spec|vector|decode": sha256}`` for every case."""
    import torch

    # NOTE: the public path, the same in trees before and after the package was split.
    from superneurons.compress import parse_spec

    torch.set_num_threads(1)
    out: dict[str, str] = {}
    vectors = _vectors()
    for spec in SPECS:
        codec = parse_spec(spec)
        for name, vector in vectors.items():
            assert isinstance(vector, torch.Tensor)
            payloads = [
                codec.encode(vector * scale, generator=torch.Generator().manual_seed(seed))
                for seed, scale in enumerate((1.0, -0.5, 2.0))
            ]
            raw = payloads[0].data.contiguous().view(torch.uint8).numpy().tobytes()
            out[f"{spec}|{name}|payload"] = hashlib.sha256(raw).hexdigest()
            total = codec.decode_sum(payloads).contiguous().view(torch.int32)
            out[f"{spec}|{name}|decode"] = hashlib.sha256(total.numpy().tobytes()).hexdigest()
            single = codec.decode(payloads[1]).contiguous().view(torch.int32)
            out[f"{spec}|{name}|decode1"] = hashlib.sha256(single.numpy().tobytes()).hexdigest()
    return out


def _run(src: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    result = subprocess.run(
        [sys.executable, __file__, "--digests"], env=env, check=True, capture_output=True, text=True
    )
    return json.loads(result.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--digests", action="store_true", help="print this tree's digests")
    parser.add_argument("--reference-src", type=Path, help="a reference tree's src/ to compare")
    args = parser.parse_args()
    if args.digests:
        json.dump(digests(), sys.stdout)
        return 0
    if args.reference_src is None:
        parser.error("give --digests or --reference-src")
    here = Path(__file__).resolve().parents[1] / "src"
    reference, current = _run(args.reference_src), _run(here)
    differ = sorted(key for key in reference if reference[key] != current.get(key))
    for key in differ:
        print(f"DIFFERS {key}" + (" (a stated change)" if stated(key) else ""))
    unexpected = [key for key in differ if not stated(key)]
    print(
        f"{len(reference) - len(differ)}/{len(reference)} digests identical; "
        f"{len(differ) - len(unexpected)} differ as stated, {len(unexpected)} unexpectedly"
    )
    return 1 if unexpected else 0


if __name__ == "__main__":
    raise SystemExit(main())
