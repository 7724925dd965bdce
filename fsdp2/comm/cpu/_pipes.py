"""The small messages of read exchanges, over pipes between the ranks of one host.

A read exchange (``_cma.py``) moves no data in messages. What it still sends are a few
bytes each: the 16-byte schedule header, the descriptor saying where the chunks are,
and the one-byte acknowledgement once they are read; about 120 messages per step for a
6-block model on 2 ranks. Over gloo each costs far more than its size: posting one takes
the pair's lock, which gloo's I/O thread holds while it works, and a receive completes
only once that thread has run, which, with every core computing, waits for a time slice.
Steps are shorter with these messages on pipes (docs/performance.md, "What bounds it here").

Ranks whose reads were probed (``_cma.probe``) connect (:func:`connect`, collective):
each rank makes one named pipe (FIFO) per peer to receive from, in a private directory
of its own, and opens each peer's pipe to it for writing. The names are removed once
every rank has opened its pipes, so nothing is left on disk, and a pipe closes when its
process exits (the peer then reads an end of file instead of waiting). A forked child (a
data-loader worker) closes its copies at once.

:class:`Pipes` has the part of a process group's interface the exchanges use
(``rank``, ``size``, ``send``, ``recv``), with gloo's matching: a receive gets the
messages of its peer and tag in the order they were sent. A send writes at once and
never waits for the peer to receive (while a pipe is full, the sender drains its own
incoming pipes into memory, so ranks writing to each other cannot deadlock). A
receive waits in ``wait()``, at most the process group's timeout; after a timeout, a
closed pipe or a frame that cannot be one of fsdp2's (a size below 0 or over
``MAX_FRAME``), every later wait on that peer fails at once, as gloo closes the pair.

``FSDP2_CPU_PIPES=0`` keeps these messages on gloo (groups connected afterwards).
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import shutil
import struct
import tempfile
import time
from typing import Sequence

import torch
import torch.distributed as dist

from ... import _compat, _wire

__all__ = ["PIPES_ENV", "Pipes", "connect", "link"]

PIPES_ENV = "FSDP2_CPU_PIPES"
_FRAME = struct.Struct("<qq")  # each message: its tag and its size in bytes, then the bytes
# The most one message may hold: a descriptor of 4M tensors, far beyond any group's. A frame
# saying more (or less than 0) comes from a stream out of step or not written by fsdp2.
MAX_FRAME = 64 << 20
_F_SETPIPE_SZ = 1031  # Linux fcntl: a pipe's capacity
_CAPACITY = 1 << 20  # the default most an unprivileged process may ask for
logger = logging.getLogger(__name__)


class _Peer:
    """This rank's two pipes with one peer, and the messages read from it but not yet received."""

    __slots__ = ("rank", "inbox", "out", "unparsed", "arrived", "posted", "stash", "broken", "corrupt")

    def __init__(self, rank: int, inbox: int, out: int) -> None:
        self.rank = rank  # the peer's global rank, for errors
        self.inbox, self.out = inbox, out  # file descriptors: the peer's pipe to here, ours to it
        self.unparsed = bytearray()
        self.arrived: dict[int, int] = {}  # tag -> messages read so far
        self.posted: dict[int, int] = {}  # tag -> receives posted so far
        self.stash: dict[tuple[int, int], bytes] = {}  # (tag, n) -> the n-th message with that tag
        self.broken = ""  # why no message will come any more (timeout, closed pipe, corrupt stream)
        self.corrupt = False  # a frame could not be one of fsdp2's: no byte after it is parsed

    def parse(self) -> None:
        """Move every whole frame read so far into ``stash``. A frame whose size is negative or
        over ``MAX_FRAME`` breaks the peer (nothing after it can be framed): the messages
        before it are delivered, every wait for a later one fails at once, saying why."""
        data = self.unparsed
        start = 0
        while len(data) - start >= _FRAME.size and not self.corrupt:
            tag, size = _FRAME.unpack_from(data, start)
            if not 0 <= size <= MAX_FRAME:
                self.corrupt = True
                self.broken = (f"rank {self.rank} sent a pipe frame of {size} bytes (tag {tag}), where a frame "
                               f"holds 0 to {MAX_FRAME}: its stream is corrupt (out of step, or not written by fsdp2)")
                break
            end = start + _FRAME.size + size
            if len(data) < end:
                break
            n = self.arrived.get(tag, 0)
            self.arrived[tag] = n + 1
            self.stash[tag, n] = bytes(data[start + _FRAME.size:end])
            start = end
        if self.corrupt:
            data.clear()
        else:
            del data[:start]


class _Sent:
    """A send's work: the bytes are in the pipe when ``send`` returns."""

    __slots__ = ()

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_SENT = _Sent()


class _Receive:
    """A posted receive: ``wait()`` copies the ``n``-th message with ``tag`` from ``peer`` into ``tensor``.

    Like gloo's works, waiting again once it is done returns at once.
    """

    __slots__ = ("pipes", "peer", "tag", "n", "tensor", "done")

    def __init__(self, pipes: Pipes, peer: _Peer, tag: int, n: int, tensor: torch.Tensor) -> None:
        self.pipes, self.peer, self.tag, self.n, self.tensor = pipes, peer, tag, n, tensor
        self.done = False

    def wait(self, timeout: object = None) -> bool:
        if self.done:
            return True
        key = (self.tag, self.n)
        peer = self.peer
        if key not in peer.stash:
            self.pipes.wait_for(peer, key)
        data = peer.stash.pop(key)
        t = self.tensor
        nbytes = t.numel() * t.element_size()
        if len(data) != nbytes:
            raise RuntimeError(
                f"fsdp2: a message of {len(data)} bytes from rank {peer.rank} arrived where this rank "
                f"expects {nbytes} (tag {self.tag}): the ranks disagree on what they exchange"
            )
        ctypes.memmove(t.data_ptr(), data, nbytes)
        self.done = True
        return True

    def is_completed(self) -> bool:
        """Whether ``wait()`` would return at once (reads what has arrived, never waits)."""
        if self.done:
            return True
        if (self.tag, self.n) not in self.peer.stash:
            self.pipes.poll_now()
        return (self.tag, self.n) in self.peer.stash or bool(self.peer.broken)


class Pipes:
    """A process group's ranks on one host, connected by pipes (see the module docstring)."""

    def __init__(self, pg: dist.ProcessGroup, peers: dict[int, _Peer], timeout_s: float) -> None:
        self.peers = peers  # group rank -> _Peer
        self.timeout_s = timeout_s
        self._rank, self._size = pg.rank(), pg.size()
        self._inboxes = {p.inbox: p for p in peers.values()}
        self._writing = False  # a frame is being written: no other may start (see try_send)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int) -> _Sent:
        (t,) = tensors
        nbytes = t.numel() * t.element_size()
        if nbytes > MAX_FRAME:
            raise ValueError(f"fsdp2: a pipe message holds at most {MAX_FRAME} bytes, not {nbytes} (tag {tag}): "
                             "send it over the process group")
        self._write(self.peers[peer], _FRAME.pack(tag, nbytes) + ctypes.string_at(t.data_ptr(), nbytes))
        return _SENT

    def recv(self, tensors: Sequence[torch.Tensor], peer: int, tag: int) -> _Receive:
        (t,) = tensors
        p = self.peers[peer]
        n = p.posted.get(tag, 0)
        p.posted[tag] = n + 1
        return _Receive(self, p, tag, n, t)

    def try_send(self, tensor: torch.Tensor, peer: int, tag: int) -> bool:
        """Send at once if that cannot wait or interleave, else do nothing; whether it was sent.

        For code that may run anywhere, even inside another send (a finalizer at garbage
        collection): one write of a frame of at most ``PIPE_BUF`` bytes is all or nothing,
        and none is made while another frame is half written. A peer that is gone counts
        as sent (nobody is left to tell).
        """
        p = self.peers.get(peer)
        nbytes = tensor.numel() * tensor.element_size()
        if p is None or self._writing or _FRAME.size + nbytes > getattr(select, "PIPE_BUF", 512):
            return p is None
        if p.broken:
            return True
        try:
            os.write(p.out, _FRAME.pack(tag, nbytes) + ctypes.string_at(tensor.data_ptr(), nbytes))
        except BlockingIOError:
            return False
        except OSError:
            p.broken = p.broken or f"rank {p.rank} closed its end of the pipe (it exited)"
        return True

    def poll_now(self) -> None:
        """Read whatever has arrived on any incoming pipe, without waiting."""
        if not self._inboxes:
            return
        poller = select.poll()
        for fd, source in self._inboxes.items():
            if not source.broken:
                poller.register(fd, select.POLLIN)
        for fd, _ in poller.poll(0):
            source = self._inboxes.get(fd)
            if source is not None:
                self._drain(source)

    def _write(self, peer: _Peer, message: bytes) -> None:
        self._writing = True
        try:
            self._write_frame(peer, message)
        finally:
            self._writing = False

    def _write_frame(self, peer: _Peer, message: bytes) -> None:
        view = memoryview(message)
        deadline = None
        while view:
            if peer.broken:
                raise RuntimeError(f"fsdp2: cannot send to rank {peer.rank}: {peer.broken}")
            try:
                view = view[os.write(peer.out, view):]
                continue
            except BlockingIOError:
                pass  # the pipe is full: read what the peers sent meanwhile, until it drains
            except BrokenPipeError:
                peer.broken = f"rank {peer.rank} closed its end of the pipe (it exited)"
                raise RuntimeError(f"fsdp2: Connection closed by peer: {peer.broken}") from None
            deadline = deadline or time.monotonic() + self.timeout_s
            self._poll(deadline, peer, writing=True)

    def wait_for(self, peer: _Peer, key: tuple[int, int]) -> None:
        """Read from every peer until ``key`` has arrived from ``peer``; raise on a timeout or a closed pipe."""
        deadline = time.monotonic() + self.timeout_s
        while key not in peer.stash:
            if peer.broken:
                raise RuntimeError(f"fsdp2: no message can come from rank {peer.rank} any more: {peer.broken}")
            self._poll(deadline, peer, writing=False)

    def _poll(self, deadline: float, peer: _Peer, writing: bool) -> None:
        """Wait until ``peer``'s pipe can be written (``writing``) or any incoming pipe has data; read it."""
        poller = select.poll()
        for fd, source in self._inboxes.items():
            if not source.broken:  # a closed pipe would report itself again at once, forever
                poller.register(fd, select.POLLIN)
        if writing:
            poller.register(peer.out, select.POLLOUT)
        left = deadline - time.monotonic()
        events = poller.poll(max(0, int(left * 1000))) if left > 0 else []
        if not events:
            ms = int(self.timeout_s * 1000)
            peer.broken = f"timed out after {ms}ms"
            raise RuntimeError(
                f"fsdp2: Timed out waiting {ms}ms to {'send to' if writing else 'receive from'} rank "
                f"{peer.rank} (the same-host pipe of the read exchanges)"
            )
        for fd, _ in events:
            source = self._inboxes.get(fd)
            if source is not None:
                self._drain(source)

    def _drain(self, peer: _Peer) -> None:
        while True:
            try:
                chunk = os.read(peer.inbox, _CAPACITY)
            except BlockingIOError:
                break
            if not chunk:
                peer.broken = peer.broken or f"rank {peer.rank} closed its end of the pipe (it exited)"
                break
            peer.unparsed += chunk
        peer.parse()

    def close(self) -> None:
        for p in self.peers.values():
            p.broken = p.broken or "the pipes were closed (their process group was destroyed)"
            for fd in (p.inbox, p.out):
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.peers.clear()
        self._inboxes.clear()


_links: dict[int, tuple[dist.ProcessGroup, Pipes | None]] = {}  # id(pg) -> (pg, its pipes or None)


def link(pg: dist.ProcessGroup) -> Pipes | dist.ProcessGroup:
    """What the read exchanges over ``pg`` send their messages on: its pipes, or ``pg`` itself."""
    entry = _links.get(id(pg))
    return entry[1] if entry is not None and entry[0] is pg and entry[1] is not None else pg


def _forget_all_in_child() -> None:
    """After ``fork()``, in the child: close every pipe (a data-loader worker never uses them,
    and its copies of the write ends would keep a dead rank's peers from seeing it exit)."""
    for _, pipes in _links.values():
        if pipes is not None:
            pipes.close()
    _links.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all_in_child)


def _forget_destroyed_groups() -> None:
    for key, (pg, pipes) in list(_links.items()):
        if not _compat.is_live_process_group(pg):
            if pipes is not None:
                pipes.close()
            del _links[key]


def _open_inboxes(world: int, me: int) -> tuple[str, dict[int, int]]:
    """A private directory with one FIFO per peer (``from-<peer>``), each opened for reading
    (non-blocking: the waits happen in ``poll``)."""
    directory = tempfile.mkdtemp(prefix="fsdp2-pipes-")
    inboxes: dict[int, int] = {}
    for peer in range(world):
        if peer != me:
            path = os.path.join(directory, f"from-{peer}")
            os.mkfifo(path, 0o600)
            inboxes[peer] = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    return directory, inboxes


def _open_outboxes(directories: Sequence[str], me: int) -> dict[int, int]:
    """Each peer's FIFO from this rank, opened for writing (no wait: every reader is open)."""
    outs: dict[int, int] = {}
    try:
        for peer, directory in enumerate(directories):
            if peer == me:
                continue
            fd = os.open(os.path.join(directory, f"from-{me}"), os.O_WRONLY | os.O_NONBLOCK)
            outs[peer] = fd
            _grow(fd)
    except OSError:
        for fd in outs.values():
            os.close(fd)
        raise
    return outs


def _grow(fd: int) -> None:
    """Ask for a pipe of ``_CAPACITY`` bytes (Linux); the default 64 KiB still works: a full
    pipe is waited on, not an error. ``fcntl`` is imported here: not every platform has it."""
    try:
        import fcntl
        fcntl.fcntl(fd, _F_SETPIPE_SZ, _CAPACITY)
    except (ImportError, OSError):
        pass


def available() -> bool:
    """Whether this platform has what the pipes need (named pipes and ``poll``)."""
    return hasattr(os, "mkfifo") and hasattr(select, "poll")


def connect(pg: dist.ProcessGroup) -> bool:
    """Connect the ranks of ``pg`` by pipes (collective, once per group); whether they are.

    Every rank of ``pg`` must call it at the same point, after ``_cma.probe(pg)`` found that
    they share a host. Any rank failing (no FIFOs on its file system, a peer's directory out
    of reach) leaves the whole group on gloo's messages.
    """
    entry = _links.get(id(pg))
    if entry is not None and entry[0] is pg:
        return entry[1] is not None
    _forget_destroyed_groups()
    me, world = pg.rank(), pg.size()
    wanted = os.environ.get(PIPES_ENV, "1") != "0" and world > 1 and available()
    directory, inboxes, outs, why = None, {}, {}, ""
    if wanted:
        try:
            directory, inboxes = _open_inboxes(world, me)
        except OSError as e:
            why = f"making the pipes: {e}"
    directories: list[str | None] = _wire.all_gather_json(directory if wanted and not why else None, pg)
    missing = [q for q, directory in enumerate(directories) if directory is None]
    if wanted and not why and missing:
        why = f"rank {dist.get_global_rank(pg, missing[0])} could not make its pipes"
    if wanted and not why:
        try:
            outs = _open_outboxes(directories, me)
        except OSError as e:
            why = f"opening a peer's pipe: {e}"
    flag = torch.tensor([int(wanted and not why)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=pg)  # also: every rank has opened its pipes
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)  # the open pipes stay
    pipes = None
    if flag.item():
        ranks = dist.get_process_group_ranks(pg)
        peers = {q: _Peer(ranks[q], inboxes[q], outs[q]) for q in inboxes}
        pipes = Pipes(pg, peers, _compat.process_group_timeout(pg))
    else:
        for fd in (*inboxes.values(), *outs.values()):
            os.close(fd)
        if wanted:
            logger.info("fsdp2: the ranks %s read each other's memory but send its messages over gloo (%s)",
                        dist.get_process_group_ranks(pg), why or "a peer could not connect")
    _links[id(pg)] = (pg, pipes)
    return pipes is not None
