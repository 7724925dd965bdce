"""What the ``FSDPModule`` setters choose for one group, in one object the group reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..comm._comm import DEFAULT_ALL_GATHER, DEFAULT_REDUCE_SCATTER, process_group_comms
from ..comm._transport import Transport, flat_transport

__all__ = ["GroupPolicy"]


@dataclass
class GroupPolicy:
    """One parameter group's settings. ``fully_shard`` and the ``FSDPModule`` setters write
    it; the group reads it at each step. Fields that change how bytes move (comms, the
    reduce-scatter group, allocation) go through ``ParamGroup`` methods, which pick the
    transports again."""

    reshard_after_forward: bool | int | None = None
    """None until the root's lazy init resolves it (the root keeps its parameters)."""
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True
    """HSDP: all-reduce across replicas after the reduce-scatter (False: sums wait)."""
    early_release: bool = False
    """``set_early_release``: a group holding other groups (the root) frees its parameters a
    part at a time after forward and in backward (``EarlyRelease``); False: as torch, kept from
    forward to the end of backward."""
    reduce_unused: bool = False
    """``set_reduce_scatter_unused_params``: zeros for gradients the rank did not produce."""
    unshard_in_backward: bool = True
    """False: backward needs none of the values (e.g. embeddings), so no all-gather then."""
    force_sum: bool = False
    """``set_force_sum_reduction_for_comms``: SUM then divide, never the backend's AVG."""
    all_reduce_hook: tuple[Any, Any] | None = None
    """``set_all_reduce_hook``: (fn, CUDA stream or None), run on each reduced gradient."""
    divide_factor: float | None = None
    """``set_gradient_divide_factor``; None: the data-parallel world size."""
    check_finite: bool = False
    """``set_check_finite_gradients``: record non-finite reduced gradients."""
    max_reduce_buffers: int | None = None
    """``set_reduce_scatter_max_input_buffers``; None: the transport's default."""
    mp_policy: Any = None
    """The ``MixedPrecisionPolicy``, handed to all-gather extensions' pre-all-gather hooks."""
    custom_all_gather: Any = None
    """``set_custom_all_gather``: the comm (``fsdp2.AllGather``) that runs the all-gather, flat."""
    custom_reduce_scatter: Any = None
    """``set_custom_reduce_scatter``: the comm that runs the reduce-scatter, flat."""
    reduce_group: dist.ProcessGroup | None = None
    """``set_separate_reduce_scatter_group``; None: the shard group."""
    weight_block: int = 0
    """``fully_shard(comm_policy=QuantizedComm(weights="int8"))``: elements per scale of the
    quantized all-gather; 0 (the default): the weights are gathered unquantized."""
    weight_bits: int = 8
    """``QuantizedComm(weights="int4")``: 4, the quantized all-gather's values are int4 (two per
    byte); 8 (the default): int8. Read only where ``weight_block`` is set."""
    grad_block: int = 0
    """``QuantizedComm(gradients="int8")``: elements per scale of the quantized reduce-scatter
    (an int8 all-to-all on the flat transport); 0 (the default): reduced in the reduce dtype."""
    grad_bits: int = 8
    """``QuantizedComm(gradients="int4")``: 4, the quantized reduce-scatter's values are int4
    (two per byte); 8 (the default): int8. Read only where ``grad_block`` is set."""
    replicate_grad_block: int = 0
    """``QuantizedComm(gradient_axes="replicate"|"both")``: elements per scale of HSDP's
    quantized all-reduce (``grad_bits`` bits per value); 0 (the default): unquantized."""
    error_feedback: bool = False
    """``QuantizedComm(error_feedback=True)``: each parameter's quantization error is kept and
    added to its next gradient before quantizing."""
    allocate_from_process_group: bool = False
    """``set_allocate_memory_from_process_group_for_comm``: fsdp2's comms allocate from the
    process group (NCCL can register the memory)."""

    def transports(self, transport: Transport, process_group: dist.ProcessGroup) -> tuple[Transport, Transport]:
        """The all-gather's and the reduce-scatter's transports for a group on ``transport``: it,
        run by this policy's comms; a custom comm runs its collective flat (the exchanges have no
        single collective to replace); quantized gradients stay on ``transport`` (no custom comm
        can run them)."""
        if self.allocate_from_process_group:
            all_gather, reduce_scatter = process_group_comms(process_group, self.reduce_group or process_group)
        else:
            all_gather, reduce_scatter = DEFAULT_ALL_GATHER, DEFAULT_REDUCE_SCATTER
        all_gather = self.custom_all_gather or all_gather
        reduce_scatter = self.custom_reduce_scatter or reduce_scatter
        own = transport.with_comms(all_gather, reduce_scatter)
        flat = flat_transport(all_gather, reduce_scatter)
        gather = flat if self.custom_all_gather is not None else own
        if self.grad_block:
            return gather, own.quantizing_gradients(self.grad_block, self.grad_bits)
        return gather, flat if self.custom_reduce_scatter is not None else own
