"""Letting this job's same-host ranks read this process under Yama's ``ptrace_scope=1``.

``process_vm_readv`` needs the reader to be allowed to ptrace the process it reads.
Linux's own rule (same user, not a setuid program) is the one that NCCL's and Open MPI's
same-host transports rely on. Yama, where it is on, narrows it: with
``kernel.yama.ptrace_scope=1`` (Ubuntu's default) a process may only be read by its
ancestors, unless it names a reader with ``prctl(PR_SET_PTRACER, pid)``, which then
allows that process and its descendants. One pid per process, so fsdp2 names the
narrowest one that covers every same-host peer of every process group it reads over:

* one peer: that peer;
* several, all children of one process (the launcher: torchrun's agent, ``mp.spawn``'s
  parent, ``mpirun``'s daemon, a shell script): that parent, whose descendants are the job;
* several, all children of one of them (a rank that started the others): that rank.

Anything else (ranks started apart, or a parent that is pid 1, whose descendants are
everything) is not narrowed to the job: those ranks send messages instead, which the
probe logs at INFO. The declaration is withdrawn (``PR_SET_PTRACER`` 0) or narrowed
again as soon as a group that needed it is destroyed (``destroy_process_group`` shuts it
down, which fsdp2 hears of: ``_compat.call_after_process_group_shutdown``), the last one
withdrawing it. ``ptrace_scope`` 2 and 3 allow no
such exception; 0 needs none. Nothing here runs without Yama.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import NamedTuple, Sequence

import torch.distributed as dist

from ... import _compat

__all__ = ["Rank", "allow", "forget", "forget_destroyed", "scope", "tracer_for"]

PR_SET_PTRACER = 0x59616D61  # "Yama"
SCOPE_PATH = "/proc/sys/kernel/yama/ptrace_scope"
logger = logging.getLogger(__name__)


class Rank(NamedTuple):
    """A process as the probe sees it: its pid and its parent's."""

    pid: int
    ppid: int


_needs: dict[int, tuple[dist.ProcessGroup, frozenset[Rank]]] = {}  # id(pg) -> (pg, its same-host peers)
_declared = 0  # the pid this process named as its ptracer (0: none)


def scope() -> int | None:
    """Yama's ``ptrace_scope`` (0-3), or None where Yama is off or this is not Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open(SCOPE_PATH) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def tracer_for(peers: Sequence[Rank]) -> int | None:
    """The one pid whose process and descendants are the narrowest set holding every one of
    ``peers``; None when no such pid is narrow enough (see the module docstring)."""
    peers = list(dict.fromkeys(peers))
    if not peers:
        return None
    if len(peers) == 1:
        return peers[0].pid
    parents = {p.ppid for p in peers}
    if len(parents) == 1:
        (parent,) = parents
        return parent if parent > 1 else None
    for head in peers:  # one of them started all the others
        if head.pid > 1 and all(p.ppid == head.pid for p in peers if p is not head):
            return head.pid
    return None


def allow(pg: dist.ProcessGroup, peers: Sequence[Rank]) -> str:
    """Let ``peers`` (this rank's same-host peers in ``pg``) read this process.

    Returns "" when they may (or Yama does not stand in the way), else why not. Covers the
    peers of every other live group too: one declaration serves them all.
    """
    level = scope()
    if level is None or level == 0:
        return ""
    if level >= 2:
        return f"Yama's kernel.yama.ptrace_scope={level} lets no process read a peer"
    forget_destroyed()
    wanted = frozenset(peers).union(*(known for _, known in _needs.values()))
    tracer = tracer_for(sorted(wanted))
    if tracer is None:
        return ("Yama's kernel.yama.ptrace_scope=1, and this rank's same-host peers "
                f"{sorted(p.pid for p in wanted)} share no parent fsdp2 could let read it")
    why = _declare(tracer)
    if not why:
        _needs[id(pg)] = (pg, frozenset(peers))
        # Withdrawn (or narrowed) the moment the group is destroyed, not at some later probe.
        _compat.call_after_process_group_shutdown(forget)
    return why


def forget(pg: dist.ProcessGroup) -> None:
    """``pg``'s peers need not read this process any more (its reads are off, or it was
    destroyed): narrow the declaration to the groups left, or withdraw it."""
    entry = _needs.get(id(pg))
    if entry is not None and entry[0] is pg:
        del _needs[id(pg)]
        _narrow()


def forget_destroyed() -> None:
    """Drop the peers of destroyed groups; withdraw or narrow the declaration to match."""
    dead = [key for key, (pg, _) in _needs.items() if not _compat.is_live_process_group(pg)]
    for key in dead:
        del _needs[key]
    if dead:
        _narrow()


def _narrow() -> None:
    wanted = frozenset().union(*(known for _, known in _needs.values()))
    tracer = tracer_for(sorted(wanted)) if wanted else 0
    if tracer is not None:
        _declare(tracer)


def _declare(tracer: int) -> str:
    """Name ``tracer`` as this process's ptracer (0: withdraw) unless it already is; "" or why not."""
    global _declared
    if tracer == _declared:
        return ""
    why = _set_ptracer(tracer)
    if why:
        return why
    _declared = tracer
    logger.debug("fsdp2: pid %s may now read this process (prctl PR_SET_PTRACER)", tracer or "none")
    return ""


def _set_ptracer(tracer: int) -> str:
    """The system call itself, ``prctl(PR_SET_PTRACER, tracer)``; "" or why it failed."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return "this libc has no prctl"
    if prctl(ctypes.c_int(PR_SET_PTRACER), ctypes.c_ulong(tracer), ctypes.c_ulong(0), ctypes.c_ulong(0),
             ctypes.c_ulong(0)) != 0:
        err = ctypes.get_errno()
        return f"prctl(PR_SET_PTRACER, {tracer}) failed: {os.strerror(err)}"
    return ""


def _forget_all_in_child() -> None:
    """After ``fork()``, in the child: Yama's exception belongs to the parent only."""
    global _declared
    _needs.clear()
    _declared = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all_in_child)
