"""Attention on the meta device as the CPU runs it: the planner's one op that differs by device.

The planner runs the model on the meta device (``_simulate.py``), playing a CPU run. Every op
allocates there what it allocates on the CPU, except ``F.scaled_dot_product_attention``: it
picks its kernel by the device, and the meta device always gets the math one (the
``(batch, heads, seq, seq)`` attention matrix, saved for backward), where the CPU takes its
flash kernel whenever that supports the call (the output and a ``(batch, heads, seq)``
log-sum-exp). ``CpuAttention`` asks the CPU which kernel it would take (tiny stand-ins, one
position long: the choice depends on dtypes, ranks, head counts and sizes, strides of the
last dim, masks and flags, not on the sequence length) and calls that kernel on the meta
tensors; its meta implementation and autograd formula are torch's own. Plain tensors only:
attention on DTensors (not the recipe's tensor parallelism, which hands it local tensors)
still takes the math kernel here. Backward's recomputation of a checkpointed block runs with
the step's modes set aside: the planner's checkpoint wrapper enters this mode again there.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import _compat

__all__ = ["CpuAttention"]

class CpuAttention(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` on plain meta tensors through the kernel the CPU picks."""

    def __init__(self) -> None:
        super().__init__()
        self._choices: dict[tuple, bool] = {}  # the CPU's choice (flash or not) by what it depends on

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out = self._attention(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

    def _attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor | None:
        tensors = [query, key, value] + ([attn_mask] if attn_mask is not None else [])
        if not all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_meta for t in tensors):
            return None  # subclasses (DTensor) as they are: on meta, the math kernel
        if not self._flash(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
            return None  # the math kernel, as on the CPU
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # as the CPU's: True keeps, False masks
            attn_mask = torch.where(attn_mask, 0.0, torch.scalar_tensor(-math.inf, dtype=query.dtype, device="meta"))
        return _compat.cpu_flash_attention(query, key, value, dropout_p, is_causal, attn_mask, scale)

    def _flash(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
               dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> bool:
        tensors = [query, key, value] + ([attn_mask] if attn_mask is not None else [])
        signature = (tuple((t.dtype, t.shape[:-2], t.shape[-1], t.stride(-1) == 1, t.requires_grad) for t in tensors),
                     dropout_p, is_causal, scale, enable_gqa, torch.is_grad_enabled())
        if signature not in self._choices:
            # (This mode is off inside its own handler; the tracker's dispatch mode is set aside.)
            with _compat.outside_dispatch_modes():
                stand_ins = [_one_position(t) for t in tensors[:3]] + [_one_cell(t) for t in tensors[3:]]
                q, k, v = stand_ins[:3]
                self._choices[signature] = _compat.cpu_picks_flash_attention(
                    q, k, v, stand_ins[3] if attn_mask is not None else None, dropout_p, is_causal, scale, enable_gqa)
        return self._choices[signature]


def _one_cell(mask: torch.Tensor) -> torch.Tensor:
    """A CPU mask as ``mask`` for one query and one key position."""
    return torch.zeros((*mask.shape[:-2], 1, 1) if mask.dim() >= 2 else (1,) * mask.dim(), dtype=mask.dtype)


def _one_position(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor as ``t`` but one position long (its last dim's stride kept 1 or not)."""
    shape = (*t.shape[:-2], 1, t.shape[-1]) if t.dim() >= 2 else tuple(t.shape)
    out = torch.zeros(shape, dtype=t.dtype, device="cpu")
    if t.dim() >= 1 and t.stride(-1) != 1 and t.shape[-1] > 1:
        out = torch.zeros((*shape[:-1], shape[-1] * 2), dtype=t.dtype, device="cpu")[..., ::2]
    return out.requires_grad_(t.requires_grad and t.dtype.is_floating_point)
