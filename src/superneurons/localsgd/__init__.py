"""Local SGD / DiLoCo: ranks train apart for H steps, then take one outer step together.

:mod:`.diloco` is the outer loop (:func:`attach_local_sgd`, :class:`LocalSGD`); :mod:`.transport`
how the outer gradient travels (fp32, or any codec with error feedback). The configuration,
``--sync diloco[...]``, is :class:`superneurons.schemes.diloco.DiLoCo`.
"""

from superneurons.localsgd.diloco import LocalSGD, attach_local_sgd
from superneurons.localsgd.transport import Transport, transport_for

__all__ = ["LocalSGD", "Transport", "attach_local_sgd", "transport_for"]
