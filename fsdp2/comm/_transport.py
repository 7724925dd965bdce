"""Which transport a group gets: the flat collectives or the CPU exchange.

The interface both implement is ``_interface.py`` (re-exported here for the files that
import it from this one). Two implementations:

* ``FlatTransport`` (``_flat.py``): one ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
  per collective (or a custom comm), on side streams. The path NCCL takes; runs on gloo too.
* ``ExchangeTransport`` (``cpu/_transport.py``): point-to-point exchanges straight into and
  out of the unsharded buffer and gradients, by messages or by same-host reads. CPU only,
  imported only when a CPU group picks it.

A group gets one when it is built (:func:`choose_transport`) and again when its dtypes
or devices change; a custom comm makes that collective flat (:func:`flat_transport`).
``FSDP2_CPU_COLLECTIVES=auto|read|exchange|flat`` picks for CPU groups
(``_interface.cpu_transport`` reads it). This file sits above both implementations and
imports each only when a group takes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._interface import CPU_COLLECTIVES_ENV, BufferNeeds, GatherSource, GroupBytes, Transport, cpu_transport

if TYPE_CHECKING:
    from ._comm import AllGather, ReduceScatter

__all__ = ["CPU_COLLECTIVES_ENV", "EXCHANGE_MIN_BYTES", "BufferNeeds", "GatherSource", "GroupBytes", "Transport",
           "choose_transport", "cpu_transport", "flat_transport"]

# Below this many unsharded bytes a group's exchange costs more than gloo's flat collective:
# each point-to-point message costs a fixed time to post on gloo, whatever its size, while
# the flat collective's extra copies and slower transfer grow with the bytes; the two cross
# between 0.5 and 2 MiB (docs/performance.md, "Small costs behind the code").
EXCHANGE_MIN_BYTES = 2**20


def choose_transport(device: torch.device, unsharded_bytes: int) -> Transport:
    """The transport of a group with ``unsharded_bytes`` of unsharded parameters on ``device``.

    CPU (gloo) groups of at least ``EXCHANGE_MIN_BYTES`` exchange point to point: faster than
    gloo's flat collectives there, and with no flat buffer to copy through; they read the
    peers' memory where the ranks allow it. Smaller CPU groups, and every group on an
    accelerator (NCCL), use the flat collectives. ``FSDP2_CPU_COLLECTIVES`` overrides this for
    CPU groups built afterwards: ``read`` or ``exchange`` (messages only) always, ``flat``
    never (the path NCCL takes, which runs on gloo too, so the tests cover it without a GPU).
    """
    choice = cpu_transport()
    if device.type != "cpu" or choice == "flat" or (choice == "auto" and unsharded_bytes < EXCHANGE_MIN_BYTES):
        return flat_transport()
    from .cpu._transport import exchange_transport  # the CPU transport, only where a group takes it

    return exchange_transport(may_read=choice != "exchange", must_read=choice == "read")


def flat_transport(all_gather: AllGather | None = None, reduce_scatter: ReduceScatter | None = None,
                   grad_block: int = 0, grad_bits: int = 8) -> Transport:
    """The flat collectives, run by ``all_gather`` / ``reduce_scatter`` (fsdp2's defaults if None);
    ``grad_block``: the gradients reduced as ``grad_bits``-bit values (8 or 4) with a scale per
    that many elements."""
    from ._flat import FlatTransport

    return FlatTransport(all_gather, reduce_scatter, grad_block, grad_bits)
