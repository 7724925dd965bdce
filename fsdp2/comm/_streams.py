"""Where each stage of the schedule runs, and how a later stage waits for an earlier one.

The schedule (``_group.py``) is written once. It issues a stage inside
``streams.side(kind)`` and gets back a :class:`Completion`; whoever needs the
result calls ``Completion.wait()``.

* **CPU (gloo)**: there is one stream, the calling thread. ``side()`` does
  nothing; collectives run ``async_op=True`` on gloo's threads and ``wait()``
  blocks the host on the work handle.
* **CUDA (NCCL)**: copy-in, all-gather, reduce-scatter and what follows a
  reduce-scatter (HSDP all-reduce, divide, accumulation, offload copies: the
  all-reduce stream) each run on their own stream, so the next group's
  all-gather overlaps the current group's compute. ``wait()`` only makes the
  current stream wait on an event (any number of waiting streams, each once):
  the host never blocks, except in ``wait_host()``.

Memory safety on CUDA without ``Tensor.record_stream``: the caching allocator
hands a freed block to the next allocation *on the stream that allocated it*.
Every side-stream stage starts by waiting on the compute stream as it is at
issue time, so a block that a side stream allocated, the compute stream used
and the host then dropped can only be reused by work ordered after that use.
Blocks allocated on the compute stream and read by a side stream (unsharded
gradients read by the reduce-scatter's copy-in) are kept alive by the in-flight
record until the compute stream has waited on the side stream's completion; the
reduce-scatter output the all-reduce stream works on, and the partial sums (HSDP
without all-reduce) it adds in, by ``runtime/_reduction.ReducedGrads`` until the end of backward.

``tests/comm/test_cuda.py`` checks the CUDA side, also under ``TORCH_CUDA_SANITIZER=1``
(``benchmarks/gpu_check.sh`` runs both on a GPU machine: one H100/H200, torch 2.11).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import ContextManager, Iterator

import torch
import torch.distributed as dist

__all__ = ["Completion", "Streams", "streams_for"]

_NO_STREAM = nullcontext()  # CPU: every stage runs on the calling thread, in order


class Completion:
    """The end of one issued stage: a work handle (CPU) or an event on a side stream (CUDA).

    Any number of waiters: each ``wait()`` orders its caller after the stage. On CPU the
    first wait blocks the host until the work is done and later ones return at once; on
    CUDA each waiting stream waits on the event once (a second wait on the same stream
    adds nothing, a wait on another stream adds that stream's dependency).
    """

    __slots__ = ("work", "event", "_streams_waited")

    def __init__(self, work: dist.Work | None = None, event: torch.cuda.Event | None = None) -> None:
        self.work = work
        self.event = event
        self._streams_waited: set[int] = set()  # CUDA: the streams already ordered after the event

    def wait(self) -> None:
        """Order the caller after the stage: block the host (CPU) or the current stream (CUDA)."""
        if self.work is not None:
            self.work.wait()  # the host is now past the work: every later waiter on it is too
            self.work = None
        if self.event is not None:
            stream = torch.cuda.current_stream()
            if stream.cuda_stream not in self._streams_waited:
                stream.wait_event(self.event)
                self._streams_waited.add(stream.cuda_stream)

    def wait_host(self) -> None:
        """Block the host until the stage has run (CUDA: the event has fired), e.g. before the
        host reads memory a side stream copies into (CPU offload's gradients)."""
        self.wait()
        if self.event is not None:
            self.event.synchronize()

    @property
    def pending(self) -> bool:
        """Whether no waiter has been ordered after the stage yet."""
        return self.work is not None or (self.event is not None and not self._streams_waited)

    def waited_on(self, stream: torch.cuda.Stream) -> bool:
        """CUDA: whether ``stream`` has been ordered after the stage."""
        return stream.cuda_stream in self._streams_waited


class Streams:
    """The side streams of one device (none on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        # CUDA: the side stream ``side()`` made current, None outside it. Inside a stage the
        # current stream is known: no ``torch.cuda.current_stream`` call (a few microseconds of
        # Python each, several per stage) to ask for it again.
        self._active: torch.cuda.Stream | None = None
        if self.cuda:
            # High priority: communication should not queue behind compute kernels.
            self.copy_in = torch.cuda.Stream(device, priority=-1)
            self.all_gather = torch.cuda.Stream(device, priority=-1)
            self.reduce_scatter = torch.cuda.Stream(device, priority=-1)
            # After each reduce-scatter: HSDP's all-reduce, the post-divide, the gradient's
            # accumulation and CPU offload's copy to the host, off the compute stream.
            self.all_reduce = torch.cuda.Stream(device, priority=-1)

    def side(self, kind: str) -> ContextManager[None]:
        """Run the enclosed stage on stream ``kind`` ("copy_in", "all_gather", "reduce_scatter",
        "all_reduce")."""
        if not self.cuda:
            return _NO_STREAM  # (reentrant: one for every stage)
        return self._on_side_stream(getattr(self, kind))

    @contextmanager
    def _on_side_stream(self, stream: torch.cuda.Stream) -> Iterator[None]:
        # First wait for everything the compute stream issued so far: the inputs are
        # ready, and blocks freed by the host are no longer in use (module docstring).
        stream.wait_stream(torch.cuda.current_stream(self.device))
        outer, self._active = self._active, stream
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            self._active = outer

    def after(self, completion: Completion | None) -> None:
        """Inside ``side()``: make the side stream wait for an earlier stage (e.g. copy-in)."""
        if completion is not None and completion.event is not None:
            self._current().wait_event(completion.event)

    def issued(self, work: dist.Work | None) -> Completion:
        """Inside ``side()``: the completion of the collective (or copies) just issued."""
        if not self.cuda:
            return Completion(work=work)
        if work is not None:
            work.wait()  # NCCL: the side stream (not the host) waits for the collective
        event = torch.cuda.Event()
        event.record(self._current())
        return Completion(event=event)

    def _current(self) -> torch.cuda.Stream:
        return self._active if self._active is not None else torch.cuda.current_stream(self.device)


_STREAMS: dict[torch.device, Streams] = {}


def streams_for(device: torch.device) -> Streams:
    """One set of side streams per device per process, shared by every group."""
    if device not in _STREAMS:
        _STREAMS[device] = Streams(device)
    return _STREAMS[device]
