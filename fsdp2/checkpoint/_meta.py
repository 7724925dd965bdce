"""A model built on the meta device, materialized for loading: what a checkpoint fills.

``load`` and ``load_full`` call :func:`materialize` first, so they load into a model that
was built on the meta device and sharded but never given storage, as DCP's
``set_model_state_dict(..., broadcast_from_rank0=True)`` does. Only what a checkpoint holds
is allocated: ``fully_shard``-ed parameters as this rank's shards on their group's device
(the same parameter objects: an optimizer made before still refers to them), other
parameters and persistent buffers whole, next to them. Values are zeros until loaded.
Non-persistent buffers (rotary tables and the like) are in no checkpoint: they stay on the
meta device, with a warning naming them, for the model's own initialisation to fill.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..runtime._state import get_state

__all__ = ["materialize"]

logger = logging.getLogger(__name__)


def materialize(model: nn.Module) -> None:
    """Allocate the parameters and persistent buffers of ``model`` still on the meta device."""
    groups = {id(g): g for s in map(get_state, model.modules()) if s is not None for g in s.groups}
    device = next((g.device for g in groups.values()), torch.device("cpu"))
    for group in groups.values():
        group.materialize()
    left: list[str] = []
    for prefix, module in model.named_modules():
        for param in module._parameters.values():
            if param is not None and param.is_meta and not isinstance(param, DTensor):  # fsdp2's are done
                torch.utils.swap_tensors(param, nn.Parameter(torch.zeros_like(param, device=device),
                                                             requires_grad=param.requires_grad))
        for name, buffer in module._buffers.items():
            if buffer is None or not buffer.is_meta:
                continue
            if name in module._non_persistent_buffers_set:
                left.append(f"{prefix}.{name}" if prefix else name)
            else:
                torch.utils.swap_tensors(buffer, torch.zeros_like(buffer, device=device))
    if left:
        logger.warning("fsdp2.checkpoint: non-persistent buffers %s are on the meta device and in no checkpoint; "
                       "initialize them before the first forward (the model's own init, or to_empty() and "
                       "recomputing them)", left)
