"""Copying straight out of a peer process's memory: the same-host CPU transport.

Ranks on one Linux host can read each other's memory with ``process_vm_readv``
("cross-memory attach", the way MPI libraries move large messages within a
node): one copy by the reader, straight from the peer's tensor into its own, and
no work at all for the peer. Loopback TCP, which gloo uses, costs a copy into the
kernel, a copy out of it and the protocol on both sides (the CPU each costs per MB:
docs/performance.md, "What bounds it here").

The peer still says *where* to read and *when*: ``_exchange.py`` sends a small
descriptor (``describe``) over the process group once the data is in place, and
the reader answers with an acknowledgement once it has read, after which the
peer may free or overwrite that memory.

Whether it works is probed once per process group (``probe``): the ranks exchange their
pids and host keys (boot id, host name, PID namespace, and the node ``FSDP2_NODE`` names, if
set: ``node``); where every key is the same, every
rank reads a random token from every peer and checks it, then the ranks agree (the same
answer on every rank, or the transports would not match). Ranks whose host keys differ read
nothing at all (a peer's pid would name another process here); where ptrace rules or a
seccomp filter forbid the call, the token reads fail or come back wrong. Either way the
ranks fall back to messages. Every later read checks that the descriptor names the pid the
probe recorded for that peer (``read``): a descriptor is only a message.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import secrets
import sys
from typing import Sequence

import torch
import torch.distributed as dist

from . import _yama
from ... import _compat, _wire

__all__ = ["NODE_ENV", "describe", "node", "pids", "probe", "read", "usable"]

_IOV_MAX = 1024  # iovecs per call on Linux
NODE_ENV = "FSDP2_NODE"
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a host name's characters, or a number
logger = logging.getLogger(__name__)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_readv = None
_usable: dict[int, tuple[dist.ProcessGroup, bool, tuple[int, ...]]] = {}  # id(pg) -> (pg, verdict, pids)


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
    """``[pid, address, nbytes, address, nbytes, ...]`` of contiguous CPU ``tensors`` (int64).

    Raises ``ValueError`` for a tensor that is not a contiguous CPU tensor: a peer would
    read the wrong bytes (its address and size say one dense run of memory).
    """
    values = [os.getpid()]
    for i, t in enumerate(tensors):
        _check_dense(t, f"offered tensor {i}", "describe")
        values += [t.data_ptr(), t.numel() * t.element_size()]
    return torch.tensor(values, dtype=torch.int64)


def _check_dense(t: torch.Tensor, which: str, what: str) -> None:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"fsdp2: {what}: {which} is {'not on the CPU' if t.device.type != 'cpu' else 'not contiguous'} "
            f"(shape {tuple(t.shape)}, stride {t.stride()}, {t.device}): a same-host read moves one dense "
            "run of CPU memory; pass a contiguous CPU tensor (e.g. stage it through .contiguous())"
        )


def read(descriptor: torch.Tensor, places: Sequence[torch.Tensor], what: str, pid: int | None) -> None:
    """Copy the peer memory ``descriptor`` lists into ``places`` (contiguous, in the same order).

    ``pid`` is the peer's process as the probe recorded it (``pids``): a descriptor is a
    message, and one naming any other process (a third process of the same user, this one)
    is refused, never read.

    Raises ``ValueError`` for a place that is not a contiguous CPU tensor (the bytes would
    land in the wrong elements), ``RuntimeError`` if the descriptor names another pid than
    ``pid`` (or ``pid`` is None: nothing was recorded), if the sizes do not match ``places``
    (the ranks disagree on what moves) or the kernel copies less than asked.
    """
    for i, t in enumerate(places):
        _check_dense(t, f"place {i}", what)
    values = descriptor.tolist()
    named, regions = values[0], values[1:]
    if pid is None or named != pid:
        raise RuntimeError(
            f"fsdp2: {what}: the peer's descriptor names pid {named}, but "
            + (f"the probe recorded pid {pid} for that peer" if pid is not None else "the probe recorded no pid for it")
            + ": refusing to read another process's memory (the ranks' messages are out of step, or not "
            "fsdp2's)"
        )
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


def pids(pg: dist.ProcessGroup) -> tuple[int, ...]:
    """The process ids of ``pg``'s ranks (group rank order) where ``probe(pg)`` said yes, else ()."""
    entry = _usable.get(id(pg))
    return entry[2] if entry is not None and entry[0] is pg and entry[1] else ()


def node() -> str:
    """This rank's node as ``FSDP2_NODE`` names it; "" where it is unset (the host alone decides).

    Ranks of one host whose node names differ never read each other: they send messages, as
    ranks on two machines do, which is how one machine stands in for several in tests
    (docs/multi-node.md). Opt-in, not torchrun's ``GROUP_RANK``: torchrun sets that on every
    launch (several agents on one host would lose their reads unasked), and other launchers
    (``srun`` alone, ``mpirun``, ``mp.spawn``) set nothing like it.

    Raises ``ValueError`` naming the variable and the fix for a value that is not a name
    (empty, spaces, punctuation): a typo there would silently merge or split nodes.
    """
    value = os.environ.get(NODE_ENV)
    if value is None:
        return ""
    if not _NODE_NAME.fullmatch(value):
        raise ValueError(
            f"fsdp2: {NODE_ENV}={value!r} is not a node name: use 1 to 64 letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit, the same on every rank of one node (e.g. {NODE_ENV}=0 for the "
            f"first launch's ranks, {NODE_ENV}=1 for the second's), or unset it"
        )
    return value


def _host() -> int:
    """Names this host, PID namespace and node (63 bits): ranks with the same name may read each other."""
    parts = [node()]
    for path in ("/proc/sys/kernel/random/boot_id", "/etc/hostname"):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            parts.append("")
    try:
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        parts.append(str(os.getpid()))  # nothing to tell hosts apart by: this process only
    digest = hashlib.blake2b("|".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _cannot_read(pg: dist.ProcessGroup, rows: Sequence[torch.Tensor]) -> str:
    """Why this rank must not read its peers, found before any read; "" when it may try.

    A peer whose host key differs is on another host or in another PID namespace (or names
    another node, ``FSDP2_NODE``): the pid in its row names some other process here (or none,
    or one that must be treated as remote), so nothing is read from it at all.
    """
    if _readv_fn() is None:
        return "has no process_vm_readv"
    mine = int(rows[pg.rank()][_ROW_HOST])
    elsewhere = [q for q, row in enumerate(rows) if int(row[_ROW_HOST]) != mine]
    if elsewhere:
        rank = dist.get_global_rank(pg, elsewhere[0])
        return (f"is not on the host (or in the PID namespace, or the {NODE_ENV} node) of rank {rank}: "
                "their host keys differ")
    return _let_peers_read(pg, rows)


def _let_peers_read(pg: dist.ProcessGroup, rows: Sequence[torch.Tensor]) -> str:
    """Yama: let this rank's same-host peers read it (``_yama.py``); "" or why they may not."""
    me = pg.rank()
    peers = [_yama.Rank(int(row[0]), int(row[_ROW_PPID])) for q, row in enumerate(rows) if q != me]
    why = _yama.allow(pg, peers)
    return f"cannot let its peers read it ({why})" if why else ""


# The probe's row per rank: describe([token]) (pid, address, size), the token (4), then:
_ROW_PPID, _ROW_HOST = 7, 8


def probe(pg: dist.ProcessGroup) -> bool:
    """Whether every rank of ``pg`` can read every other's memory (once per group; collective).

    Every rank of ``pg`` must call it at the same point. Under Yama's ``ptrace_scope=1``
    each rank first lets its same-host peers read it (``_yama.py``).
    """
    entry = _usable.get(id(pg))
    if entry is not None and entry[0] is pg:
        return entry[1]
    for key, (known, *_) in list(_usable.items()):  # let destroyed groups (and their sockets) go
        if not _compat.is_live_process_group(known):
            del _usable[key]
    verdict, ids = False, ()
    if pg.size() > 1:
        verdict, ids = _probe(pg)
        if not verdict:
            _yama.forget(pg)
    _usable[id(pg)] = (pg, verdict, ids)
    return verdict


def _probe(pg: dist.ProcessGroup) -> tuple[bool, tuple[int, ...]]:
    """``probe``'s collectives: who is where, whether each rank lets its peers in, the reads, the verdict."""
    ranks = dist.get_process_group_ranks(pg)
    token = torch.tensor([secrets.randbits(63) for _ in range(4)], dtype=torch.int64)
    try:
        host, bad = _host(), ""
    except ValueError as e:  # raised below on every rank alike, not here alone (the others would hang)
        host, bad = 0, str(e)
    mine = torch.cat([describe([token]), token, torch.tensor([os.getppid(), host], dtype=torch.int64)])
    rows = [torch.empty_like(mine) for _ in range(pg.size())]
    dist.all_gather(rows, mine, group=pg)
    why = _cannot_read(pg, rows) if not bad else "has a bad node name"  # every rank sees every host key
    # Also the barrier that keeps every read after every rank's Yama declaration.
    reasons, errors = zip(*_wire.all_gather_json([why, bad], pg))
    if any(errors):
        bad_rank = next(q for q, e in enumerate(errors) if e)
        raise ValueError(f"{errors[bad_rank]} (rank {ranks[bad_rank]}'s environment)")
    why = f"this rank {why}" if why else ""
    for peer, row in enumerate(rows):
        if why:
            break
        if peer == pg.rank():
            continue
        if reasons[peer]:
            why = f"rank {ranks[peer]} {reasons[peer]}"
            break
        got = torch.zeros(4, dtype=torch.int64)
        try:
            read(row[:3], [got], "probe", pid=int(row[0]))  # the pid recorded: the one in its row
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
            "exchanges over this process group send messages instead", ranks, why or "a peer could not read")
    return verdict, tuple(int(row[0]) for row in rows)
