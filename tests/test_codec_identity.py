"""Every codec's payload and decodes equal those of the tree before the speed work, byte for
byte, except the stated changes (``benchmarks/codec_payload_identity.py``'s STATED_CHANGES).

``codec_digests.json`` holds the first 16 hex digits of each SHA-256 digest that
``codec_payload_identity.py --digests`` printed for the source tree before the change (44
specs, 12 vectors, payload, ``decode_sum`` of three payloads and one ``decode``: 1584).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _identity_module():  # type: ignore[no-untyped-def]
    path = ROOT / "benchmarks" / "codec_payload_identity.py"
    spec = importlib.util.spec_from_file_location("codec_payload_identity", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_payloads_and_decodes_equal_the_recorded_digests() -> None:
    identity = _identity_module()
    recorded = json.loads((ROOT / "tests" / "codec_digests.json").read_text())
    got = {key: digest[:16] for key, digest in identity.digests().items()}
    assert set(got) == set(recorded)  # every spec and vector still covered
    differ = sorted(key for key in recorded if got[key] != recorded[key])
    assert all(identity.stated(key) for key in differ), [
        key for key in differ if not identity.stated(key)
    ]
    # a stated change moves only what it says; everything else is byte-identical
    assert len(differ) <= 3 * len(identity.STATED_CHANGES)
