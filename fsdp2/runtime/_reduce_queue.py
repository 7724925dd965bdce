"""Reduce-scatters in flight, shared by the groups of one root, and how many may be.

Split from ``_group.py``: the group issues its reduce-scatters and hands them here; the
queue finishes them (``_reduction.finish_reduction``) when room is needed and at the
end of backward, and keeps what CUDA's all-reduce stream still works on until then.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

from ..comm._collectives import ReduceScatterInFlight
from ._reduction import ReducedGrads, Reduction, finish_reduction

__all__ = ["ReduceQueue"]


class ReduceQueue:
    """Reduce-scatters in flight, oldest first, waited on only when needed.

    Bounded: each submit leaves at most its group's limit in flight (their buffers and
    gradients alive); the root's end-of-backward callback drains it. On CUDA, a finished
    reduce-scatter leaves work on the all-reduce stream (``ReducedGrads``, with the buffers
    it uses, partial sums of steps without all-reduce included): kept here until the drain
    orders the compute stream after it.
    """

    def __init__(self) -> None:
        self._pending: collections.deque[Reduction] = collections.deque()
        self._reduced: list[ReducedGrads] = []

    def make_room(self, limit: int) -> None:
        """Before a group issues its reduce-scatter: finish the oldest until fewer than ``limit``
        are in flight, so their buffers are freed before the new ones are allocated."""
        while len(self._pending) >= limit:
            self._finish(self._pending.popleft())

    def submit(self, inflight: Sequence[Reduction], limit: int) -> None:
        """Queue ``inflight``; then finish the oldest until at most ``limit`` are left in flight
        (more than one only where a group reduces several dtypes)."""
        self._pending.extend(inflight)
        while len(self._pending) > limit:
            self._finish(self._pending.popleft())

    def _finish(self, reduction: Reduction) -> None:
        reduced = finish_reduction(reduction)
        if reduced.outstanding:  # CUDA: the all-reduce stream may still use what it keeps
            self._reduced.append(reduced)

    def in_flight(self, group: Any) -> list[ReduceScatterInFlight]:
        """The reduce-scatters of ``group`` still in flight (for the memory tracker)."""
        mine = {id(p) for p in group.params}
        return [r.inflight for r in self._pending if r.params and id(r.params[0]) in mine]

    def drain(self) -> None:
        while self._pending:
            self._finish(self._pending.popleft())
        self.land()

    def land(self) -> None:
        """Order the compute stream (and the host, for offloaded gradients) after the finished
        reduce-scatters' all-reduce-stream work (CUDA; nothing to do on CPU)."""
        while self._reduced:
            self._reduced.pop(0).land()

    def discard(self) -> None:
        """Wait for the reduce-scatters in flight (their buffers must outlive them) but drop the results."""
        while self._pending:
            self._pending.popleft().inflight.done.wait()
        while self._reduced:  # the all-reduce stream's work: waited, its offloaded gradients dropped
            self._reduced.pop(0).done.wait()
