"""Model-aware synchronisation: measure the network and the codecs, choose per bucket.

Pure pieces (Poseidon ATC'17, Parallax EuroSys'19, Espresso EuroSys'23): a Hockney α-β
network model (:mod:`.netmodel`), each candidate codec's measured cost (:mod:`.codecs`), the
predicted exposed step time of a choice (:mod:`.cost`) and the per-bucket selection
(:mod:`.select`). The DDP hook only carries an :class:`Assignment` out. Importing this
package starts nothing.
"""

from __future__ import annotations

from superneurons.strategy.codecs import (
    DEFAULT_CANDIDATES,
    DENSE,
    Candidate,
    CodecCost,
    measure_codecs,
)
from superneurons.strategy.cost import BucketTiming, bucket_key, predicted_step_s
from superneurons.strategy.netmodel import (
    LinkModel,
    NetworkModel,
    fit_link,
    measure_network,
    ring_network,
)
from superneurons.strategy.select import ASSIGNMENT_VERSION, Assignment, select
from superneurons.strategy.whatif import DecisionInputs, decide_at, predicted_steps

__all__ = [
    # the network (Hockney α-β)
    "LinkModel",
    "NetworkModel",
    "fit_link",
    "measure_network",
    "ring_network",
    # the candidates
    "DEFAULT_CANDIDATES",
    "DENSE",
    "CodecCost",
    "Candidate",
    "measure_codecs",
    # the cost of a choice
    "BucketTiming",
    "bucket_key",
    "predicted_step_s",
    # the choice
    "ASSIGNMENT_VERSION",
    "Assignment",
    "select",
    # the same decision at another world size or link rate
    "DecisionInputs",
    "decide_at",
    "predicted_steps",
]
