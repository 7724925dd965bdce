"""Selective activation checkpointing as torchtitan runs it ("op" level), for the memory planner.

torchtitan's op-level policy (``activation_checkpoint.mode = "selective"``, ``selective_ac_option =
"op"``) checkpoints every block with ``torch.utils.checkpoint``'s selective contexts: it saves the
outputs of matrix multiplies, except every second one of a block's forward, and of the attention
kernels (and of the reductions a sequence-parallel block ends with); everything else (norms,
activations, rotary embeddings, residual adds) is recomputed in backward. The layer-level option
(every second block fully checkpointed) is only in the step-time model: the planner simulates
two blocks and copies block 0 for the rest, which cannot stand for alternating blocks.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["op_level_contexts"]

_aten = torch.ops.aten
# Attention kernels whose outputs are kept: the CUDA ones torchtitan lists, and the CPU kernel
# the planner's simulation picks in their place (``_meta_attention.py``).
_ATTENTION = tuple(getattr(_aten, name) for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu") if hasattr(_aten, name))
_SAVED = {*(op.default for op in _ATTENTION), _aten.max.default}
_REDUCE_SCATTER = getattr(getattr(torch.ops, "_c10d_functional", None), "reduce_scatter_tensor", None)
if _REDUCE_SCATTER is not None:
    _SAVED.add(_REDUCE_SCATTER.default)


def _policy() -> Callable[..., CheckpointPolicy]:
    """One block call's policy: matmuls counted apart in forward and recompute, every second one recomputed."""
    count = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func == _aten.mm.default:
            count[ctx.is_recompute] += 1
            keep = count[ctx.is_recompute] % 2 == 1
        else:
            keep = func in _SAVED
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_level_contexts(recompute_also: contextlib.AbstractContextManager) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``checkpoint``: the selective contexts, with ``recompute_also`` entered
    around the recomputation too (the simulation's attention mode)."""
    def contexts() -> tuple[Any, Any]:
        forward, recompute = create_selective_checkpoint_contexts(_policy())
        return forward, _Both(recompute_also, recompute)

    return contexts


class _Both(contextlib.AbstractContextManager):
    """Several context managers entered as one, in order (checkpoint takes one per pass)."""

    def __init__(self, *managers: contextlib.AbstractContextManager) -> None:
        self.managers = managers
        self.stack: contextlib.ExitStack | None = None

    def __enter__(self) -> _Both:
        self.stack = contextlib.ExitStack()
        for manager in self.managers:
            self.stack.enter_context(manager)
        return self

    def __exit__(self, *exc: object) -> bool | None:
        stack, self.stack = self.stack, None
        return stack.__exit__(*exc) if stack is not None else None
