"""The planner's side of ``QuantizedComm`` that is not run: the bytes a step moves.

The buffers quantized communication holds are fsdp2's own, counted as the simulation runs
them (``_simulate.py``); what the collectives move per step (``MemoryEstimate.comm_bytes_per_step``)
is arithmetic on the groups' sizes, here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._api import QuantizedComm
from .._format import HEADER, GatherFormat
from ..comm._quantize import GradChunks

if TYPE_CHECKING:
    from ._simulate import GroupSizes

__all__ = ["wire_bytes"]


def wire_bytes(group: GroupSizes, policy: QuantizedComm | None, world: int, replicas: int) -> tuple[int, int, int]:
    """What one all-gather and one reduce-scatter of ``group`` over ``world`` ranks move, all
    ranks' parts together, and what HSDP's all-reduce over ``replicas`` moves (its two passes):
    as ``policy`` sends them (None: unquantized, in the gathered and the reduce dtype)."""
    block = policy.weight_block if policy is not None and world > 1 else 0
    gathered = GatherFormat.build(group.layouts, group.gather_dtypes, block, policy.weight_bits).slice_bytes \
        * world - HEADER * world if block else group.unsharded
    reduced, shard_out = group.reduce, group.reduce // world
    if policy is not None and policy.grad_block and world > 1:
        reduced = world * GradChunks(world, sum(lay.local_numel for lay in group.layouts), policy.grad_block,
                                     policy.grad_bits).chunk_bytes
    all_reduce = 2 * shard_out
    if policy is not None and policy.replicate_grad_block and replicas > 1:
        chunk = -(-sum(lay.local_numel for lay in group.layouts) // replicas)  # elements of each replica's part
        all_reduce = replicas * (GradChunks(replicas, chunk, policy.replicate_grad_block, policy.grad_bits).chunk_bytes
                                 + GradChunks(1, chunk, policy.replicate_grad_block, policy.grad_bits).chunk_bytes)
    return gathered, reduced, all_reduce
