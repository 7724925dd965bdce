"""Freeing a group a part at a time: the root's unsharded buffer in segments.

A group whose modules hold other groups (the root, usually: embeddings, final norm,
output head) is backward's first group and its last. Its unsharded buffer is cut into
*segments*, one storage per run of parameters a module owns (``use_segments``, at lazy
init). After forward, the segments forward took no reference to are freed
(``release_unsaved``); once backward has reached another group, the gradients that are
final are reduced and the segments all of whose gradients are final freed
(``release_finished``). See docs/design.md, "The root, a part at a time".

``PartialRelease`` is a part of ``ParamGroup`` (``_group.py``), which it extends: it reads
the group's parameters, buffers, policy and state and calls its gathers and reductions.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch.autograd.graph import get_gradient_edge

from .. import _compat
from .._common import ShardState
from ..diagnostics import _trace

if TYPE_CHECKING:
    from ._param import ShardedParam

__all__ = ["MAX_SEGMENTS", "PartialRelease", "segment_bounds"]

logger = logging.getLogger(__name__)


MAX_SEGMENTS = 16  # storages per unsharded buffer at most (one allocation each per unshard)


def segment_bounds(owners: list[Any], sizes: list[int]) -> list[int]:
    """Where a group's parameters (in order, owned by ``owners``, ``sizes`` bytes unsharded) are cut
    into segments: one per run of parameters of one module, at most ``MAX_SEGMENTS`` (the
    neighbours holding the fewest bytes merged). ``[0, ..., len(owners)]``."""
    n = len(owners)
    bounds = [0, *(i for i in range(1, n) if owners[i] is not owners[i - 1]), n]
    while len(bounds) - 1 > MAX_SEGMENTS:
        joined = [sum(sizes[bounds[k]:bounds[k + 2]]) for k in range(len(bounds) - 2)]
        del bounds[joined.index(min(joined)) + 1]
    return bounds


class PartialRelease:
    """The segments of a group's unsharded buffer and the early frees (mixed into ``ParamGroup``)."""

    def _init_release(self, n_params: int) -> None:
        self._bounds: list[int] = [0, n_params]  # segment k: parameters bounds[k]:bounds[k + 1]
        self._released: set[int] = set()  # segments freed early (release_unsaved, release_finished)
        self._refs: list[tuple[int, ...]] = []  # per segment, before forward: see release_unsaved
        self._accumulators: list[Any] = []  # held through forward: see note_forward_start
        self._recompute_handles: list[Any] = []  # see _release_segments
        self._reduced_early: set[int] = set()  # parameters reduced by release_finished this backward
        self._early_parts = 0
        # release_finished runs only from the second backward on, and only while no gradient
        # has reached a parameter twice in one backward (reentrant checkpointing of shared
        # modules), which would leave no point at which a gradient is known to be final.
        self._release_armed = False
        self._release_never = False
        self._grad_repeated = False
        # release_unsaved stops for good once a forward finds segments it freed still freed:
        # two forwards before one backward, each of which would gather the group again.
        self._keep_after_forward = False

    def use_segments(self) -> None:
        """Cut the unsharded buffer into one storage per run of parameters a module owns
        (at most ``MAX_SEGMENTS``, merging the smallest neighbours), so that backward can free
        part of it (``release_finished``). Called at lazy init for a group whose module holds
        other groups; a no-op once the buffer exists, for extension groups and without a buffer.
        """
        n = len(self.params)
        if self._buffers or self._ext is not None or self._aliases or n < 2:
            return
        self._bounds = segment_bounds([p.locations[0][0] for p in self.params], self._region_sizes())

    def _drop_recompute_hooks(self) -> None:
        for handle in self._recompute_handles:
            handle.remove()
        self._recompute_handles = []

    @property
    def segmented(self) -> bool:
        return len(self._bounds) > 2

    def _segment_params(self, k: int) -> list[ShardedParam]:
        return self.params[self._bounds[k]:self._bounds[k + 1]]

    def _segment_refs(self, k: int) -> tuple[int, ...]:
        """What holds segment ``k`` now: its storage's tensors, and each of its parameters' Python
        references and C++ handles (autograd's saved tensors and accumulators, views' bases)."""
        refs = [_compat.references(self._buffers[k])[0]]
        for p in self._segment_params(k):
            refs += _compat.references(p.unsharded)[1:]
        return tuple(refs)

    def note_forward_again(self) -> None:
        """A forward (not a recomputation) is about to gather the group. Segments still freed
        since an earlier forward mean that forward's backward has not run (two forwards summed
        into one loss): this one gathers the whole group again, and so would every such forward
        of every step. From now on forwards free nothing (``release_unsaved``): one gather per
        step, as torch's FSDP2 does; backward still frees parts (``release_finished``)."""
        if self._released and not self._keep_after_forward:
            self._keep_after_forward = True
            logger.info("fsdp2: %s was run forward again before backward; it keeps its parameters "
                        "after forward from now on (one all-gather per step)", self.label)

    def note_forward_start(self) -> None:
        """Before the group's forward: count what holds each segment (``release_unsaved``).

        The trainable parameters' gradient accumulators are made (or found) and held first, so
        that forward's own use of them adds nothing to the count."""
        if self._keep_after_forward:
            return
        self._accumulators = [get_gradient_edge(p.unsharded).node for p in self.params
                              if p.requires_grad and p.unsharded.requires_grad]
        self._refs = [self._segment_refs(k) for k in range(len(self._bounds) - 1)]

    def release_unsaved(self) -> None:
        """After a forward that keeps this group unsharded: free the segments that forward left
        nothing to read in backward (an embedding table: its backward needs the indices only).

        A segment qualifies when forward added no reference to it: no tensor on its storage
        (views, ``detach()``, what autograd saved), no Python reference to its parameters
        (``ctx.weight = weight``) and no C++ handle to them (a saved parameter itself). A forward
        re-run in backward (activation checkpointing) gathers the group whole again first
        (``_recompute_hook``).
        """
        refs, self._refs = self._refs, []
        if not refs or self.state is not ShardState.UNSHARDED or not self.policy.reshard_after_backward:
            self._accumulators = []
            return
        unsaved = [k for k, before in enumerate(refs) if k not in self._released and self._segment_refs(k) == before
                   and all(p.tp is None for p in self._segment_params(k))]
        self._accumulators = []
        self._release_segments(unsaved)

    def _recompute_hook(self, _module: Any, _args: Any) -> None:
        """A module owning parameters of this group runs inside backward (activation
        checkpointing re-running forward): gather the segments released early again."""
        if self._released and _compat.in_backward():
            self.wait_for_unshard()

    def _release_segments(self, segments: list[int]) -> None:
        """Free ``segments`` (indices into ``_buffers``): one ``release`` event for them all."""
        if not segments:
            return
        if not self._released:
            # While any segment is released, the modules owning the group's parameters gather it
            # whole again if backward re-runs their forward. Registered only until the group is
            # resharded: a (compiled) forward never meets these hooks.
            hook = _compat.run_eagerly(self._recompute_hook)
            owners = {id(m): m for p in self.params for m, _ in p.locations}
            self._recompute_handles = [m.register_forward_pre_hook(hook) for m in owners.values()]
        self._wait_peer_reads()
        _trace.emit("release", self.label)
        for k in segments:
            for p in self._segment_params(k):
                p.to_sharded()
            self._buffers[k].untyped_storage().resize_(0)
            self._released.add(k)

    def release_finished(self) -> None:
        """Backward has reached another group: reduce the gradients this group has that are
        final, and free the segments whose parameters all have final gradients.

        A gradient is final once autograd accumulated it: every use of the parameter has then
        been differentiated, and none is left to read its unsharded values. The same rule frees
        a whole group (``post_backward``); here it runs on part of one. Called on every rank at
        the same point of backward (a group's pre-backward), so the partial reduce-scatters pair
        up. Skipped where the gradients are not reduced now (no sync, HSDP keeping partial
        sums, reduction at the module's inputs) or the parameters are to stay unsharded.
        """
        if not (self._release_armed and self.backward_started) or self.post_backward_done \
                or self.state is not ShardState.UNSHARDED:
            return
        policy = self.policy
        if not (policy.requires_gradient_sync and policy.reshard_after_backward) or self.waits_for_inputs \
                or (self.dp.replicate_group is not None and (not policy.requires_all_reduce or self._partial_reduce)):
            return
        ready, done = self._grads_ready, self._reduced_early
        finished = [p for p in self.params if id(p) in ready and id(p) not in done]
        if not finished:
            return
        self._release_segments([k for k in range(len(self._bounds) - 1)
                                if k not in self._released and all(id(p) in ready for p in self._segment_params(k))])
        done.update(map(id, finished))
        self._early_parts += 1
        self._reduce_gradients(finished, f"{self.label}[part {self._early_parts}]")

    def _note_grad(self, param: ShardedParam) -> None:
        """``param``'s gradient was accumulated (``ParamGroup._on_grad_ready``)."""
        key = id(param)
        if key in self._grads_ready:  # accumulated twice in one backward: never final before the end
            self._grad_repeated = True
            if key in self._reduced_early:
                raise RuntimeError(
                    f"fsdp2: a second gradient reached {self._name_of(param)} in one backward after {self.label} "
                    "had reduced it (the first backward accumulated it only once); run the same forward "
                    "structure every iteration, or reduce at the end of backward with "
                    "set_reshard_after_backward(False)"
                )
        self._grads_ready.add(key)

    def _end_early_release(self) -> None:
        """After a backward: arm ``release_finished`` for the next one, unless a gradient came twice."""
        self._release_never = self._release_never or self._grad_repeated  # for good: the rule does not fit
        self._release_armed = self.segmented and not self._release_never
        self._grad_repeated = False
        self._reduced_early.clear()
        self._early_parts = 0

    def _forget_release(self) -> None:
        """After an exception mid-iteration (``ParamGroup.reset``)."""
        self._reduced_early.clear()
        self._grad_repeated = False
        self._early_parts = 0
