"""What a group that holds other groups (the root) may give back before the end of backward.

The root is backward's first group and its last. torch's FSDP2 keeps its parameters
unsharded from forward to the end of backward and reduces its gradients there, and so does
fsdp2 by default: user code may read the parameters through their modules meanwhile (a
penalty added to the loss after forward, a custom ``autograd.Function`` reading
``ctx.module.weight`` in backward).

``set_early_release(True)`` (opt-in, ``EarlyRelease``) frees them a part at a time instead:
the unsharded buffer is cut into *segments* (one storage per run of parameters a module
owns); after forward the segments forward took no reference to are freed; in backward, each
time backward reaches another group, the gradients that are final are reduced and the
segments whose gradients are all final and whose storage no saved tensor still holds are
freed. Its limit: code that reads a freed parameter through its module finds the sharded
DTensor there. See docs/design.md, "The root's parameters".
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from torch.autograd.graph import get_gradient_edge

from .. import _compat
from .._common import ShardState

if TYPE_CHECKING:
    import torch

    from ._param import ShardedParam
    from ._policy import GroupPolicy

__all__ = ["MAX_SEGMENTS", "EarlyRelease", "ReleaseHost", "segment_bounds"]

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


class ReleaseHost(Protocol):
    """What ``EarlyRelease`` reads and calls on its group (``ParamGroup``)."""

    params: list[ShardedParam]
    label: str
    state: ShardState
    policy: GroupPolicy
    backward_started: bool
    post_backward_done: bool

    def grads_final(self) -> set[int]: ...  # ids of the parameters whose gradient autograd accumulated
    def reduces_as_final(self) -> bool: ...  # gradients are reduced now (not kept, not at the inputs)
    def reduce_gradients(self, params: list[ShardedParam], label: str) -> None: ...
    def segments(self) -> list[list[ShardedParam]]: ...  # the unsharded buffer's, in order
    def segment_buffer(self, k: int) -> torch.Tensor: ...
    def free_segments(self, segments: list[int]) -> None: ...  # parameters back to shards, storage freed
    def wait_for_unshard(self) -> None: ...  # gathers the freed segments again


class EarlyRelease:
    """A group's early reductions and frees, while ``GroupPolicy.early_release`` is on.

    Driven by the module hooks (``_state.py``): ``before_forward`` / ``forward_started`` /
    ``forward_done`` around the group's forward, ``backward_reached`` at every other group's
    pre-backward; and by the group: ``gradient_repeated``, ``on_reshard``, ``end_backward``,
    ``reset``. ``freed``: the segments freed now (the group gathers them again when a forward
    or the user needs them).
    """

    def __init__(self, group: ReleaseHost) -> None:
        self.group = group
        self.freed: set[int] = set()  # segments freed while the rest is unsharded
        self._reduced: set[int] = set()  # ids of the parameters reduced early this backward
        self._parts = 0  # early reductions this backward (their labels: "<group>[part n]")
        # Only from the second backward on, and only while no gradient has reached a parameter
        # twice in one backward (reentrant checkpointing of a module run twice), which leaves
        # no point at which a gradient is known to be final.
        self._armed = False
        self._never = False
        self._repeated = False
        # Early frees: what held each segment before forward (see forward_started), the
        # gradient accumulators held meanwhile, and the recomputation hooks (see _free).
        self._before: list[tuple[int, ...]] = []
        self._baseline: list[tuple[int, ...]] = []
        self._accumulators: list[Any] = []
        self._recompute_handles: list[Any] = []
        # Frees after forward stop for good once a forward finds segments still freed since
        # the last one: two forwards per backward, each of which would gather the group again.
        self._keep_after_forward = False

    # ---- policy ---------------------------------------------------------------------------
    @property
    def frees(self) -> bool:
        """Parameters are freed early (opt-in) and the buffer was cut into segments for it."""
        return self.group.policy.early_release and len(self.group.segments()) > 1

    # ---- forward ---------------------------------------------------------------------------
    def before_forward(self) -> None:
        """A forward (not a recomputation) is about to gather the group. Segments still freed
        since an earlier forward mean that forward's backward has not run (two forwards summed
        into one loss): this one gathers the whole group again, and so would every such forward
        of every step. From now on forwards free nothing; backward still does."""
        if self.freed and not self._keep_after_forward:
            self._keep_after_forward = True
            logger.info("fsdp2: %s was run forward again before backward; it keeps its parameters "
                        "after forward from now on (one all-gather per step)", self.group.label)

    def forward_started(self) -> None:
        """Before the group's forward (grad mode on): count what holds each segment.

        The trainable parameters' gradient accumulators are made (or found) and held first, so
        that forward's own use of them adds nothing to the count. The first count since the
        last backward is the baseline backward's frees compare with (``backward_reached``)."""
        if not self.frees:
            return
        self._accumulators = [get_gradient_edge(p.unsharded).node for p in self.group.params
                              if p.requires_grad and p.unsharded.requires_grad]
        self._before = [self._refs(k) for k in range(len(self.group.segments()))]
        if not self._baseline:
            self._baseline = self._before

    def forward_done(self) -> None:
        """After a forward that backward follows: free the segments that forward left nothing to
        read in backward (an embedding table: its backward needs the indices only).

        A segment qualifies when forward added no reference to it: no tensor on its storage
        (views, ``detach()``, what autograd saved), no Python reference to its parameters
        (``ctx.weight = weight``) and no C++ handle to them (a saved parameter itself). A forward
        re-run in backward (activation checkpointing) gathers the group whole again first.
        """
        before, self._before = self._before, []
        group = self.group
        unsaved = []
        if before and not self._keep_after_forward and group.state is ShardState.UNSHARDED \
                and group.policy.reshard_after_backward:
            segments = group.segments()
            unsaved = [k for k, refs in enumerate(before) if k not in self.freed and self._refs(k) == refs
                       and all(p.tp is None for p in segments[k])]
        self._accumulators = []  # only now: forward_started's count included them
        self._free(unsaved)

    # ---- backward --------------------------------------------------------------------------
    def gradient_repeated(self) -> None:
        """Autograd accumulated a parameter's gradient a second time this backward. Were it
        reduced early, the second is reduced at the end of backward (the reduction is linear:
        both add up in ``.grad``); this and every later backward reduce at the end only."""
        self._repeated = True

    def backward_reached(self) -> None:
        """Backward has reached another group: reduce the gradients this group has that are
        final (every use of the parameter has been differentiated: no code can read them again),
        and, with early frees, free the segments whose parameters all have final gradients and
        whose storage nothing holds beyond what held it before forward (no saved tensor left).

        Called on every rank at the same point of backward (a group's pre-backward, after its
        wait), so the partial reduce-scatters pair up. Skipped where the gradients are not
        reduced now (no sync, HSDP keeping partial sums, reduction at the module's inputs).
        """
        group = self.group
        if not (group.policy.early_release and self._armed and group.backward_started) or group.post_backward_done \
                or group.state is not ShardState.UNSHARDED or not group.reduces_as_final():
            return
        ready = group.grads_final()
        finished = [p for p in group.params if id(p) in ready and id(p) not in self._reduced]
        if not finished:
            return
        if len(group.segments()) > 1 and group.policy.reshard_after_backward and self._baseline:
            self._free([k for k, params in enumerate(group.segments()) if k not in self.freed
                        and all(id(p) in ready for p in params) and self._unheld(k)])
        self._reduced.update(map(id, finished))
        self._parts += 1
        group.reduce_gradients(finished, f"{group.label}[part {self._parts}]")

    def end_backward(self) -> None:
        """After a backward: arm the early reductions for the next one, unless a gradient came twice."""
        self._never = self._never or self._repeated  # for good: "final" cannot be told before the end
        self._armed = not self._never
        self._forget()

    def reset(self) -> None:
        """After an exception mid-iteration (``ParamGroup.reset``)."""
        self._forget()
        self._before, self._accumulators = [], []

    def _forget(self) -> None:
        self._reduced.clear()
        self._repeated = False
        self._parts = 0
        self._baseline = []

    # ---- the segments ----------------------------------------------------------------------
    def on_reshard(self) -> None:
        """The whole buffer was freed: nothing is freed apart any more."""
        self.freed.clear()
        for handle in self._recompute_handles:
            handle.remove()
        self._recompute_handles = []

    def _refs(self, k: int) -> tuple[int, ...]:
        """What holds segment ``k`` now: its storage's tensors, and each of its parameters' Python
        references and C++ handles (autograd's saved tensors and accumulators, views' bases)."""
        refs = [_compat.references(self.group.segment_buffer(k))[0]]
        for p in self.group.segments()[k]:
            refs += _compat.references(p.unsharded)[1:]
        return tuple(refs)

    def _unheld(self, k: int) -> bool:
        """Nothing holds segment ``k`` that did not hold it before this iteration's first forward:
        what autograd saved of it has been released (a ``detach()`` alias read later in
        backward, or a graph kept with ``retain_graph``, keeps it)."""
        return all(now <= before for now, before in zip(self._refs(k), self._baseline[k]))

    def _recompute_hook(self, _module: Any, _args: Any) -> None:
        """A module owning parameters of this group runs inside backward (activation
        checkpointing re-running forward): gather the segments freed early again."""
        if self.freed and _compat.in_backward():
            self.group.wait_for_unshard()

    def _free(self, segments: list[int]) -> None:
        if not segments:
            return
        if not self.freed:
            # While any segment is freed, the modules owning the group's parameters gather it
            # whole again if backward re-runs their forward. Registered only until the group is
            # resharded (on_reshard): a (compiled) forward never meets these hooks.
            hook = _compat.run_eagerly(self._recompute_hook)
            owners = {id(m): m for p in self.group.params for m, _ in p.locations}
            self._recompute_handles = [m.register_forward_pre_hook(hook) for m in owners.values()]
        self.group.free_segments(segments)
        self.freed.update(segments)
