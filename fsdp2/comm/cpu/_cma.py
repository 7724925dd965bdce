"""Copying straight out of a peer process's memory: the same-host CPU transport.

Ranks on one Linux host can read each other's memory with ``process_vm_readv``
("cross-memory attach", the way MPI libraries move large messages within a
node): one copy by the reader, straight from the peer's tensor into its own, and
no work at all for the peer. Loopback TCP, which gloo uses, costs a copy into the
kernel, a copy out of it and the protocol on both sides: measured on the 2-core
development machine, 34 MB in 5-9 ms of the reader's CPU against about 33 ms of
both ranks' CPU over gloo.

The peer still says *where* to read and *when*: ``_exchange.py`` sends a small
descriptor (``describe``) over the process group once the data is in place, and
the reader answers with an acknowledgement once it has read, after which the
peer may free or overwrite that memory.

Whether it works is probed once per process group (``probe``): every rank reads a
random token from every peer and checks it, then the ranks agree (the same answer
on every rank, or the transports would not match). Ranks on different hosts, in
different PID namespaces, or where ptrace rules or a seccomp filter forbid the
call, read nothing or the wrong bytes, and fall back to messages.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import sys
from typing import Sequence

import torch
import torch.distributed as dist

from ... import _compat

__all__ = ["describe", "probe", "read", "usable"]

_IOV_MAX = 1024  # iovecs per call on Linux
logger = logging.getLogger(__name__)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_readv = None
_usable: dict[int, tuple[dist.ProcessGroup, bool]] = {}  # id(pg) -> (pg, verdict)


def _readv_fn():
    """libc's ``process_vm_readv`` (None where there is none)."""
    global _readv
    if _readv is None:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
            except (OSError, AttributeError):
                fn = None
        if fn is not None:
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                           ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
        _readv = fn or False
    return _readv or None


def describe(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[pid, address, nbytes, address, nbytes, ...]`` of contiguous CPU ``tensors`` (int64)."""
    values = [os.getpid()]
    for t in tensors:
        values += [t.data_ptr(), t.numel() * t.element_size()]
    return torch.tensor(values, dtype=torch.int64)


def read(descriptor: torch.Tensor, places: Sequence[torch.Tensor], what: str) -> None:
    """Copy the peer memory ``descriptor`` lists into ``places`` (contiguous, in the same order).

    Raises ``RuntimeError`` if the sizes do not match ``places`` (the ranks disagree on
    what moves) or the kernel copies less than asked.
    """
    values = descriptor.tolist()
    pid, regions = values[0], values[1:]
    if len(regions) != 2 * len(places) or any(
            regions[2 * i + 1] != t.numel() * t.element_size() for i, t in enumerate(places)):
        raise RuntimeError(
            f"fsdp2: {what}: the peer (pid {pid}) offers {len(regions) // 2} regions of "
            f"{regions[1::2]} bytes where this rank expects {[t.numel() * t.element_size() for t in places]}: "
            "the ranks disagree on what they exchange"
        )
    fn = _readv_fn()
    for start in range(0, len(places), _IOV_MAX):
        batch = places[start:start + _IOV_MAX]
        local = (_IoVec * len(batch))(*[(t.data_ptr(), t.numel() * t.element_size()) for t in batch])
        remote = (_IoVec * len(batch))(*[(regions[2 * i], regions[2 * i + 1])
                                          for i in range(start, start + len(batch))])
        want = sum(t.numel() * t.element_size() for t in batch)
        got = fn(pid, local, len(batch), remote, len(batch), 0)
        if got != want:
            err = ctypes.get_errno() if got < 0 else 0
            raise RuntimeError(
                f"fsdp2: {what}: reading {want} bytes from pid {pid} returned {got}"
                + (f" ({os.strerror(err)})" if err else "")
                + "; FSDP2_CPU_COLLECTIVES=exchange moves the data as messages instead"
            )


def usable(pg: dist.ProcessGroup) -> bool:
    """The verdict of ``probe(pg)``; False for a group never probed."""
    entry = _usable.get(id(pg))
    return entry is not None and entry[0] is pg and entry[1]


def probe(pg: dist.ProcessGroup) -> bool:
    """Whether every rank of ``pg`` can read every other's memory (once per group; collective).

    Every rank of ``pg`` must call it at the same point.
    """
    entry = _usable.get(id(pg))
    if entry is not None and entry[0] is pg:
        return entry[1]
    for key, (known, _) in list(_usable.items()):  # let destroyed groups (and their sockets) go
        if not _compat.is_live_process_group(known):
            del _usable[key]
    verdict = False
    if pg.size() > 1:
        ranks = dist.get_process_group_ranks(pg)
        token = torch.tensor([secrets.randbits(63) for _ in range(4)], dtype=torch.int64)
        why = "" if _readv_fn() is not None else "this rank has no process_vm_readv"
        mine = torch.cat([describe([token]), token, torch.tensor([int(not why)], dtype=torch.int64)])
        rows = [torch.empty_like(mine) for _ in range(pg.size())]
        dist.all_gather(rows, mine, group=pg)
        for peer, row in enumerate(rows):
            if why:
                break
            if peer == pg.rank():
                continue
            if not row[-1]:
                why = f"rank {ranks[peer]} has no process_vm_readv"
                break
            got = torch.zeros(4, dtype=torch.int64)
            try:
                read(row[:3], [got], "probe")
            except RuntimeError as e:
                why = str(e).split(";")[0]  # names the pid and the errno
                break
            if not torch.equal(got, row[3:7]):
                why = f"rank {ranks[peer]}'s token read back wrong (another PID namespace?)"
                break
        flag = torch.tensor([int(not why)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=pg)
        verdict = bool(flag.item())
        if not verdict:  # expected across hosts; on one host it costs speed (docs/troubleshooting.md)
            logger.info(
                "fsdp2: the ranks %s cannot read each other's memory with process_vm_readv (%s); CPU "
                "exchanges over this process group send messages instead (on one host: Yama's "
                "kernel.yama.ptrace_scope=0 allows the reads)", ranks, why or "a peer could not read")
    _usable[id(pg)] = (pg, verdict)
    return verdict
