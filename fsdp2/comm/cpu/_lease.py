"""Memory that same-host peers may still read stays alive until they say they are done.

A read exchange (``_exchange.ReadExchange``) tells each peer where this rank's chunks
are; the peer copies them out of this process (``_cma.read``) at its own wait, maybe
well after this rank has moved on, then acknowledges. Until that acknowledgement the
memory must stay mapped and unchanged. The runtime waits for it before it frees or
refills a buffer, but memory can also go without the runtime: the model deleted
mid-iteration (garbage collection frees the unsharded buffer, the gradients), or the
process exiting. So the guarantee lives here, with the exchange:

* every read exchange has a :class:`Lease` (its ``release``): strong references to the
  tensors the peers may read and the buffers of the messages still in flight, kept in a
  module registry until every peer has acknowledged (``Lease.wait``, which the runtime
  calls before it frees);
* an exchange dropped before that (``orphan``, from ``ReadExchange.__del__``) will not
  read the peers it has not read yet, so it acknowledges them at once (their memory may
  go) and keeps its own until their acknowledgements arrive; orphans are looked at,
  never waited on, at the start of every later read exchange (``prune``);
* at interpreter exit (``atexit``, and multiprocessing's exit hook, which its children
  run instead), ``drain`` sends what is owed and waits, at most ``EXIT_WAIT_S``, for the
  acknowledgements still missing: a peer that is gone reads nothing any more; one that
  does not answer in time is logged (WARNING) and the process exits anyway. Then it joins
  the waiter threads (gloo's, below): one still inside gloo's ``wait`` when the interpreter
  finalizes would be ended by ``pthread_exit`` as it takes the GIL back, an unwind through
  C++ that aborts the process (``terminate called without an active exception``).

Code that may run inside garbage collection (``orphan``) only posts messages that cannot
wait or interleave (``Pipes.try_send``); the rest waits for the next safe point.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import Any, Sequence

import torch

__all__ = ["EXIT_WAIT_S", "WAITER_JOIN_S", "Lease", "drain", "join_waiters", "live", "prune"]

EXIT_WAIT_S = 30.0  # at exit: the longest wait for peers still reading this process
WAITER_JOIN_S = 10.0  # at exit: the longest wait for waiter threads whose gloo works have ended
logger = logging.getLogger(__name__)

_live: dict[int, Lease] = {}  # id -> every lease not yet released, in creation order
_orphans: list[Lease] = []  # leases whose exchange was dropped before they were released
_hooked_pid = 0  # the process whose exit hooks are registered (0: none yet)
_waiters: list[threading.Thread] = []  # gloo waiter threads started (finished ones pruned), joined at exit


class Lease:
    """One read exchange's memory on offer and the messages it still owes or awaits.

    ``wait()`` (the exchange's ``release``) returns once every peer has acknowledged
    reading this rank's memory and this rank's own messages are out; until then the
    tensors given to ``hold`` stay alive, whoever else drops them.
    """

    __slots__ = ("link", "what", "ack", "ack_tag", "pids", "works", "keep", "unread", "orphaned", "done", "gone",
                 "waiter")

    def __init__(self, link: Any, what: str, ack_tag: int, pids: Sequence[int] = ()) -> None:
        _hook_exit()
        self.link, self.what, self.ack_tag, self.pids = link, what, ack_tag, tuple(pids)
        self.ack = torch.ones(1, dtype=torch.uint8)
        self.works: list[tuple[int, Any]] = []  # (group rank, work): acknowledgements due, sends in flight
        self.keep: list[torch.Tensor] = [self.ack]
        self.unread: list[int] = []  # peers this rank has yet to acknowledge (it has not read them)
        self.orphaned = self.done = False
        self.gone: set[int] = set()  # peers found exited before they acknowledged
        self.waiter: threading.Thread | None = None  # gloo: the thread waiting for the works
        _live[id(self)] = self

    def hold(self, tensors: Sequence[torch.Tensor]) -> None:
        """Keep ``tensors`` (memory on offer, message buffers) alive until released."""
        self.keep.extend(tensors)

    def send(self, peer: int, tensor: torch.Tensor, tag: int) -> None:
        self.keep.append(tensor)
        self.works.append((peer, self.link.send([tensor], peer, tag)))

    def expect_ack(self, peer: int) -> torch.Tensor:
        """Post the receive of ``peer``'s acknowledgement (returns its buffer); ``peer`` waits
        for this rank's too."""
        acked = torch.empty(1, dtype=torch.uint8)
        self.keep.append(acked)
        self.works.append((peer, self.link.recv([acked], peer, self.ack_tag)))
        self.unread.append(peer)
        return acked

    def acknowledge(self, peer: int) -> None:
        """Tell ``peer`` this rank is done with its memory."""
        self.unread.remove(peer)
        self.works.append((peer, self.link.send([self.ack], peer, self.ack_tag)))

    def wait(self) -> bool:
        """Wait for every acknowledgement due and every send; then let the memory go."""
        if self.waiter is not None:
            # gloo, a waiter thread started: it alone waits on the works. A gloo work waited on
            # by two threads hands its one completion to one of them and blocks the other for
            # good (until the connection closes, maybe at interpreter exit: an abort).
            self.waiter.join()
            if self.gone:
                raise RuntimeError(f"fsdp2: {self.what}: the connection to the same-host peer(s) "
                                   f"{sorted(self.gone)} (group ranks) failed before they acknowledged")
            return True
        while self.works:
            self.works[0][1].wait()
            self.works.pop(0)  # only once finished: a failed wait leaves it to be waited on again
        self._close()
        return True

    def orphan(self, late: Sequence[tuple[int, Any]]) -> None:
        """The exchange was dropped unfinished; ``late``: its receives never waited on (their
        buffers are held). May run inside garbage collection: posts only what cannot wait."""
        if self.done or self.orphaned:
            return
        self.orphaned = True
        self.works.extend(late)
        _orphans.append(self)
        self._acknowledge_unread(quietly=True)

    def poll(self) -> bool:
        """Progress without waiting (safe points only); whether the lease is released.

        Pipes are read as far as they have data. gloo's works cannot be asked whether they
        are done without waiting on them, so a thread of its own waits for them instead.
        """
        if self.done:
            return True
        self._acknowledge_unread(quietly=False)
        if not hasattr(self.link, "try_send"):  # gloo
            if self.waiter is None:
                self.waiter = threading.Thread(target=self._wait_all, name="fsdp2-read-lease", daemon=True)
                _waiters[:] = [t for t in _waiters if t.is_alive()]
                _waiters.append(self.waiter)
                self.waiter.start()
            elif self.works and all(_gone(self._pid(peer)) for peer, _ in list(self.works)):
                self.gone.update(peer for peer, _ in list(self.works))
                self._close()  # the waiter stays blocked on works nobody will answer
            return self.done
        pending = []
        for peer, work in self.works:
            try:
                finished = work.is_completed()
                if finished:
                    work.wait()  # completes it (a pipe's receive takes its message)
            except Exception:  # noqa: BLE001 - failed: the peer's pipe or connection is gone
                finished = True
                self.gone.add(peer)
            if not finished and _gone(self._pid(peer)):
                finished = True
                self.gone.add(peer)
            if not finished:
                pending.append((peer, work))
        self.works = pending
        if not pending and not self.unread:
            self._close()
        return self.done

    def _wait_all(self) -> None:
        """The waiter thread's work (gloo): every work in turn; a failure means the peer is gone."""
        while self.works and not self.done:
            peer, work = self.works[0]
            try:
                work.wait()
            except Exception:  # noqa: BLE001 - the connection failed or timed out
                self.gone.add(peer)
            self.works.pop(0)
        self._close()

    def waiting_on(self) -> list[int]:
        """The peers whose acknowledgements (or this rank's messages to whom) are still due."""
        return sorted({peer for peer, _ in self.works} | set(self.unread))

    def _acknowledge_unread(self, quietly: bool) -> None:
        """Acknowledge the peers this rank will not read; ``quietly``: only where that cannot
        wait or interleave with a message being written (the others at a later safe point)."""
        for peer in list(self.unread):
            try:
                if quietly and hasattr(self.link, "try_send"):  # pipes
                    if not self.link.try_send(self.ack, peer, self.ack_tag):
                        continue
                else:  # gloo posts and returns
                    self.works.append((peer, self.link.send([self.ack], peer, self.ack_tag)))
            except Exception:  # noqa: BLE001 - a closed link
                if quietly:
                    continue
                self.gone.add(peer)  # nobody is left to tell
            self.unread.remove(peer)

    def _pid(self, peer: int) -> int | None:
        return self.pids[peer] if 0 <= peer < len(self.pids) else None

    def _close(self) -> None:
        # ``done`` last: the waiter thread may close while another thread polls, and a lease
        # seen released must already be off the registry (``live``) with its memory let go.
        _live.pop(id(self), None)
        self.keep = []
        self.done = True


def live() -> list[Lease]:
    """The leases not yet released (memory peers may still read)."""
    return list(_live.values())


def prune() -> None:
    """Let go of orphaned leases whose peers have all acknowledged (never waits)."""
    if _orphans:
        _orphans[:] = [lease for lease in _orphans if not lease.poll()]


def drain(timeout_s: float) -> list[Lease]:
    """Send what every lease owes and wait up to ``timeout_s`` for what is due; the leases
    still unreleased then (logged at WARNING), for exit."""
    deadline = time.monotonic() + timeout_s
    everyone = leases = live()
    pause = 0.001
    while leases:
        leases = [lease for lease in leases if not lease.poll()]
        if not leases or time.monotonic() >= deadline:
            break
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    _orphans[:] = [lease for lease in _orphans if not lease.done]
    for lease in everyone:
        if lease.gone:
            logger.warning("fsdp2: %s: the same-host peer(s) %s (group ranks) exited without saying they had "
                           "finished reading this process's memory", lease.what, sorted(lease.gone))
    for lease in leases:
        logger.warning("fsdp2: %s: the same-host peer(s) %s (group ranks) did not say within %.0f s that they "
                       "had finished reading this process's memory; exiting anyway (a read still to come "
                       "fails on the peer)", lease.what, lease.waiting_on(), timeout_s)
    return leases


def _gone(pid: int | None) -> bool:
    """Whether process ``pid`` has exited (a zombie included); False when unknown."""
    if pid is None or not os.path.isdir("/proc/self"):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False


def join_waiters(timeout_s: float) -> list[threading.Thread]:
    """Wait up to ``timeout_s`` for the waiter threads to end; those still running then (each
    blocked on a peer that neither answered nor went away)."""
    deadline = time.monotonic() + timeout_s
    for thread in list(_waiters):
        thread.join(max(0.0, deadline - time.monotonic()))
    _waiters[:] = [t for t in _waiters if t.is_alive()]
    return list(_waiters)


def _drain_at_exit() -> None:
    if _hooked_pid != os.getpid():
        return
    if _live:
        drain(EXIT_WAIT_S)
    if stuck := join_waiters(WAITER_JOIN_S):
        logger.warning("fsdp2: %d thread(s) still wait on gloo for a same-host peer at exit; if the wait ends "
                       "while the interpreter shuts down, the process may abort", len(stuck))


def _hook_exit() -> None:
    """Register the exit drain, once per process: with ``atexit``, and with multiprocessing's
    exit hook, which its children run instead (they leave by ``os._exit``). Done at the first
    lease, not at import: a spawned child clears that hook's registry after importing its target."""
    global _hooked_pid
    if _hooked_pid == os.getpid():
        return
    _hooked_pid = os.getpid()
    atexit.register(_drain_at_exit)
    try:
        import multiprocessing.util
        multiprocessing.util.Finalize(None, _drain_at_exit, exitpriority=100)
    except (ImportError, ValueError):
        pass


def _forget_all_in_child() -> None:
    """After ``fork()``, in the child: the parent's leases (and threads) are the parent's to settle."""
    _live.clear()
    _orphans.clear()
    _waiters.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all_in_child)
