"""A group's gradient reduction, from the unsharded gradients to the sharded ``.grad``.

Issuing it: the gradients taken off the unsharded parameters, bucketed by reduce dtype,
handed to the group's reduce transport, queued on the root's ``ReduceQueue`` (at one rank
with nothing to divide by or hook, added to the shards directly). Finishing it
(:func:`finish_reduction`): what the transport gives back (this rank's reduced entries,
``comm/_collectives.py``) run through the all-reduce hook and the finite check, added into
``.grad``, then the user's post-accumulate-grad hooks.

``ParamGroup.post_backward`` reduces the whole group; ``EarlyRelease`` the gradients that are
final early (``ParamGroup.reduce_gradients``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch

from .. import _compat
from ..comm._collectives import ReduceScatterInFlight, ReduceTarget, reduce_across_replicas, wait_reduce_scatter
from ..comm._streams import Completion, streams_for
from ..diagnostics import _trace
from . import _checks
from ._shapes import GroupShape

if TYPE_CHECKING:
    from ._param import ShardedParam

__all__ = ["Reduction", "ReducedGrads", "finish_reduction", "reduce_gradients"]


class Reduction(NamedTuple):
    """A reduce-scatter in flight and what its result becomes: the parameters whose ``.grad``
    it adds to (in the transport's order), the all-reduce hook and the finite check."""

    inflight: ReduceScatterInFlight
    params: tuple[ShardedParam, ...]
    hook: Any = None  # set_all_reduce_hook: (fn, stream or None), run on each finished reduction
    check_finite: bool = False  # record non-finite reduced gradients (set_check_finite_gradients)


def reduce_gradients(group: GroupShape, params: list[ShardedParam] | None = None, label: str | None = None) -> None:
    """Reduce the gradients of ``params`` (all of the group's by default, resharding it first
    where it reshards after backward; ``EarlyRelease`` passes the final ones)."""
    whole = params is None
    params, label = (group.params if whole else params), (label or group.label)
    if group.shards_are_full and group.policy.all_reduce_hook is None:  # one rank: the gradient is the reduced gradient
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
        all_reduce=policy.requires_all_reduce, partial=group.partial_sums,
        divide_factor=float(policy.divide_factor if policy.divide_factor is not None else dp.world),
        label=label, root=group.root, force_sum=policy.force_sum,
        replicate_block=policy.replicate_grad_block, replicate_bits=policy.grad_bits,
    )
    if whole and policy.reshard_after_backward:  # the parameters' memory first, then the buffers'
        group.reshard()
    limit = policy.max_reduce_buffers or transport.reduce_scatters_in_flight(group.world)
    group.reduce_queue.make_room(limit)
    _trace.emit("reduce_scatter", group.label)
    with _trace.profiled("fsdp2::reduce_scatter", label), _trace.issuing("reduce_scatter", label):
        # The flat transport empties each ``grads`` list once copied in: the unsharded
        # gradients are freed before the output is allocated.
        inflight = [
            Reduction(transport.start_reduce_scatter(
                [p.layout for p in params], grads, dtype, target, group.device,
                _checks.reduce_header(group, params) if transport.reduce_headers else None,
                **({"residuals": [_residual(p, group) for p in params]} if policy.error_feedback else {})),
                tuple(params), policy.all_reduce_hook, policy.check_finite)
            for dtype, (params, grads) in buckets.items()
        ]
    del buckets
    group.reduce_queue.submit(inflight, limit)


def _residual(p: ShardedParam, group: GroupShape) -> torch.Tensor:
    """``p``'s error-feedback residual (``QuantizedComm(error_feedback=True)``): what quantizing
    its gradient lost last time, fp32, ``(world, local_numel)`` (its full padded size, rank-major),
    zeros at first; kept on the parameter for the run."""
    res = p.grad_residual
    if res is None or res.shape != (group.world, p.layout.local_numel):
        res = p.grad_residual = torch.zeros(group.world, p.layout.local_numel, device=group.device)
    return res


def _gradient_to_reduce(group: GroupShape, p: ShardedParam) -> torch.Tensor | None:
    """``p``'s unsharded gradient (cleared on the parameter); zeros where it got none and
    the group reduces unused parameters; None otherwise.

    A parameter frozen since an unsynced backward still reduces the gradient it kept."""
    grad = p.take_unsharded_grad()
    if grad is None and group.policy.reduce_unused and p.requires_grad:
        grad = p.zero_unsharded_grad()
    return grad


# ---- finishing a reduction ------------------------------------------------------------
class ReducedGrads(NamedTuple):
    """What a finished reduction left on the all-reduce stage, on either back-end.

    ``done``: the stage's completion (all-reduce, post-divide, accumulation into ``.grad``,
    offload copies). ``keep``: every buffer the stage reads or writes: the reduce-scatter's
    output and the partial sums of steps without all-reduce that it added in; on CUDA the
    caller holds them until the compute stream has waited on ``done`` (:meth:`land`), or the
    caching allocator could hand their blocks to the next reduce-scatter while the all-reduce
    stream still reads them. ``deferred``: CPU-offloaded gradient shards copied to pinned
    host memory without blocking, added into ``.grad`` (and their hooks run) once the host
    has seen the copies land. On CPU the stage ran on the calling thread: nothing is
    ``outstanding``.
    """

    done: Completion
    keep: tuple[torch.Tensor, ...]
    deferred: tuple[tuple[ShardedParam, torch.Tensor], ...]

    @property
    def outstanding(self) -> bool:
        """Whether the caller must keep this until :meth:`land`: the stage may still be running
        (no stream waited on it yet) or offloaded gradients wait to be added."""
        return self.done.pending or bool(self.deferred)

    def land(self) -> None:
        """Order the compute stream (and, for offloaded gradients, the host) after the work."""
        self.done.wait()
        if self.deferred:
            self.done.wait_host()  # the host adds into (and the optimizer reads) host memory
            for p, staged in self.deferred:
                p.add_sharded_grad(staged)
                p.run_sharded_grad_hooks()


def finish_reduction(reduction: Reduction) -> ReducedGrads:
    """Wait for the reduce-scatter, finish its communication (HSDP's all-reduce, the division),
    add each rank's entries into the sharded ``.grad``, then run the sharded parameters'
    post-accumulate-grad hooks (none while HSDP defers its all-reduce).

    One path, two back-ends. CPU: in order on the calling thread, as the collectives'
    waits block it. CUDA: the compute stream waits for the reduce-scatter only (its input,
    the unsharded gradients, may then be freed); everything after it runs on the all-reduce
    stream, which the compute stream waits on only when it reads the results: before user
    hooks on the sharded parameters run, and at the end of backward (``ReducedGrads.land``).
    Either way the returned record names what the stage uses; the caller keeps it while it
    is ``outstanding`` (CUDA only). CPU-offloaded gradient shards go to host memory with
    non-blocking copies there, added once landed.
    """
    inflight = reduction.inflight
    out = wait_reduce_scatter(inflight)  # CUDA: the compute stream waits
    streams = streams_for(out.device)
    with streams.side("all_reduce"):
        inflight.done.wait()  # CUDA: the all-reduce stream too (a second waiter)
        replicas = reduce_across_replicas(inflight, out)
        landed, deferred = _accumulate(reduction, out, streams.cuda) if replicas.all_reduced else ([], [])
        done = streams.issued(None)
    reduced = ReducedGrads(done, (out, *replicas.read), tuple(deferred))
    if not replicas.all_reduced:
        return reduced  # HSDP with its all-reduce off: the sums wait in target.partial
    if streams.cuda and any(_compat.has_post_accumulate_grad_hooks(p.sharded) for p in landed):
        done.wait()  # user hooks (e.g. an optimizer step per parameter) read .grad on the compute stream
    for p in landed:
        p.run_sharded_grad_hooks()  # the user's, e.g. an optimizer step per parameter
    _trace.emit("reduce_scatter_done", inflight.target.label, scheduled=False)
    return reduced


def _accumulate(reduction: Reduction, out: torch.Tensor, cuda: bool
                ) -> tuple[list[ShardedParam], list[tuple[ShardedParam, torch.Tensor]]]:
    """On the all-reduce stage: run the all-reduce hook on ``out``, then add each parameter's
    entry into its ``.grad``, or, CUDA with CPU offload, stage it to host memory. Returns the
    parameters whose ``.grad`` is final, and the (parameter, staged entry) pairs."""
    if reduction.hook is not None:
        _run_all_reduce_hook(*reduction.hook, out)
    shards = reduction.inflight.shards(out)
    if reduction.check_finite:
        _checks.record_nonfinite(reduction.inflight.target.root, reduction.params, shards)
    landed: list[ShardedParam] = []
    deferred: list[tuple[ShardedParam, torch.Tensor]] = []
    for p, shard in zip(reduction.params, shards):
        if cuda and p.padded_local.device.type == "cpu":
            deferred.append((p, _stage_to_host(p, shard)))
        else:
            p.add_sharded_grad(shard)
            landed.append(p)
    return landed, deferred


def _run_all_reduce_hook(fn: Callable[[torch.Tensor], None], stream: Any, reduced: torch.Tensor) -> None:
    """``fn(reduced)`` (in place), on ``stream`` when one was given (CUDA), ordered both ways."""
    if stream is None:
        fn(reduced)
        return
    current = torch.cuda.current_stream(reduced.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        fn(reduced)
    current.wait_stream(stream)


def _stage_to_host(p: ShardedParam, shard: torch.Tensor) -> torch.Tensor:
    """CUDA, CPU offload: ``shard`` copied (cast to the parameter's dtype) into host memory,
    pinned and without blocking where the parameter is pinned; the copy lands with the stream."""
    staged = torch.empty(shard.shape, dtype=p.orig_dtype, device="cpu", pin_memory=p.pin_memory)
    staged.copy_(shard, non_blocking=p.pin_memory)
    return staged
