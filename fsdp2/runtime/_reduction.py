"""Issuing a group's gradient reduction: the gradients taken off the unsharded parameters,
bucketed by reduce dtype, handed to the group's reduce transport, queued on the root's
``ReduceQueue``; at one rank with nothing to divide by or hook, added to the shards directly.

``ParamGroup.post_backward`` reduces the whole group; ``EarlyRelease`` the gradients that are
final early (``ParamGroup.reduce_gradients``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..comm._collectives import ReduceTarget
from ..diagnostics import _checks, _trace

if TYPE_CHECKING:
    from ._group import ParamGroup
    from ._param import ShardedParam

__all__ = ["reduce_gradients"]


def reduce_gradients(group: ParamGroup, params: list[ShardedParam] | None = None, label: str | None = None) -> None:
    """Reduce the gradients of ``params`` (all of the group's by default, resharding it first
    where it reshards after backward; ``EarlyRelease`` passes the final ones)."""
    whole = params is None
    params, label = (group.params if whole else params), (label or group.label)
    if group._aliases and group.policy.all_reduce_hook is None:  # one rank: the gradient is the reduced gradient
        _trace.emit("reduce_scatter", group.label)
        factor = group.policy.divide_factor
        for p in params:
            grad = _gradient_to_reduce(group, p)
            if grad is not None:
                grad = grad if factor in (None, 1) else grad / factor
                p.add_sharded_grad(grad.view(p.layout.local_shape))
                if group.policy.check_finite:
                    _checks.record_nonfinite(group.root, [p], [grad])
                p.run_sharded_grad_hooks()
        return
    buckets: dict[torch.dtype, tuple[list[ShardedParam], list[torch.Tensor]]] = {}
    for p in params:
        grad = _gradient_to_reduce(group, p)
        if grad is not None:
            bucket, grads = buckets.setdefault(p.reduce_dtype, ([], []))
            bucket.append(p)
            grads.append(grad)
    grad = grads = params = None  # the buckets' lists are the only references left (see below)
    if not buckets:
        return
    dp, policy, transport = group.dp, group.policy, group.reduce_transport
    target = ReduceTarget(
        group=policy.reduce_group or group.process_group, world=group.world,
        replicate_group=dp.replicate_group, replicate_world=dp.replicate_size,
        all_reduce=policy.requires_all_reduce, partial=group._partial_reduce,
        divide_factor=float(policy.divide_factor if policy.divide_factor is not None else dp.world),
        label=label, root=group.root, check_finite=policy.check_finite, force_sum=policy.force_sum,
        hook=policy.all_reduce_hook,
    )
    if whole and policy.reshard_after_backward:  # the parameters' memory first, then the buffers'
        group.reshard()
    limit = policy.max_reduce_buffers or transport.reduce_scatters_in_flight(group.world)
    group.reduce_queue.make_room(limit)
    _trace.emit("reduce_scatter", group.label)
    with _trace.profiled(f"fsdp2::reduce_scatter {label}"), _trace.issuing("reduce_scatter", label):
        # The flat transport empties each ``grads`` list once copied in: the unsharded
        # gradients are freed before the output is allocated.
        inflight = [
            transport.start_reduce_scatter(
                params, grads, dtype, target, group.device,
                _checks.reduce_header(group, params) if transport.reduce_headers else None)
            for dtype, (params, grads) in buckets.items()
        ]
    del buckets
    group.reduce_queue.submit(inflight, limit)


def _gradient_to_reduce(group: ParamGroup, p: ShardedParam) -> torch.Tensor | None:
    """``p``'s unsharded gradient (cleared on the parameter); zeros where it got none and
    the group reduces unused parameters; None otherwise.

    A parameter frozen since an unsynced backward still reduces the gradient it kept."""
    grad = p.take_unsharded_grad()
    if grad is None and group.policy.reduce_unused and p.requires_grad:
        grad = p.zero_unsharded_grad()
    return grad
