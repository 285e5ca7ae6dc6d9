"""What the wire delivered to each rank: its interface's byte counters, not sizes computed.

Each rank of the network benchmark lives in its own network namespace, where ``/proc/net/dev``
lists only that namespace's interfaces, so the counters of its veth (``GLOO_SOCKET_IFNAME``)
are what it received and sent: payloads plus TCP/IP headers and gloo's own handshakes. On
loopback every rank shares ``lo`` and the counters cannot tell ranks apart (None).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["interface_bytes", "wire_bytes_per_rank"]


def interface_bytes(ifname: str) -> tuple[int, int] | None:
    """``(received, sent)`` bytes so far on ``ifname`` in this network namespace, or None for
    loopback (every rank shares it, so it cannot tell one rank's bytes) or an unknown name."""
    if not ifname or ifname == "lo":
        return None
    try:
        lines = Path("/proc/net/dev").read_text(encoding="ascii").splitlines()[2:]
    except OSError:
        return None
    for line in lines:
        name, _, fields = line.partition(":")
        if name.strip() == ifname:
            values = fields.split()
            return int(values[0]), int(values[8])  # rx_bytes, tx_bytes
    return None


def wire_bytes_per_rank(before: tuple[int, int] | None, steps: int) -> dict[str, Any]:
    """Every rank's interface bytes per step since ``before``, agreed by an all-gather (so rank
    0 can write them): mean and max received and sent, or Nones on loopback."""
    after = interface_bytes(os.environ.get("GLOO_SOCKET_IFNAME", ""))
    mine = [-1.0, -1.0]
    if before is not None and after is not None:
        mine = [(after[0] - before[0]) / steps, (after[1] - before[1]) / steps]
    gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor(mine, dtype=torch.float64))
    received = [float(t[0]) for t in gathered]
    sent = [float(t[1]) for t in gathered]
    if min(received) < 0:
        return {"bytes_received_per_rank": None, "bytes_received_max_rank": None,
                "bytes_sent_wire_per_rank": None}  # fmt: skip
    return {
        "bytes_received_per_rank": sum(received) / len(received),
        "bytes_received_max_rank": max(received),
        "bytes_sent_wire_per_rank": sum(sent) / len(sent),
    }
