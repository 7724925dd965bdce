"""Diagnostics for collectives: debug logging, and waits whose errors say what was waited for.

A hang or a timeout inside a collective usually surfaces as a backend message
("Timed out waiting 1800000ms for recv operation") that names neither the
model part nor the step. Every wait fsdp2 does on one of its collectives goes
through :func:`wait`, which re-raises such an error with the group's label, the
collective, its sizes, the iteration and the training phase, chained to the
original.

Debug mode (``FSDP2_DEBUG=1`` in the environment when fsdp2 is imported, or
:func:`set_debug` at run time) logs every collective fsdp2 issues on the
``fsdp2`` logger at DEBUG level, and on CUDA also turns on the all-gather
header check (see ``_checks.py``), which costs a device synchronisation per
all-gather. It is process-wide, like a logging level: one switch for every
model in the process.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .. import _compat



class Waitable(Protocol):
    """Anything ``wait`` can wait on: a work handle, or a stage's ``Completion`` (``comm/_streams.py``)."""

    def wait(self) -> Any: ...

__all__ = ["enabled", "set_debug", "phase", "describe_iteration", "log_collective", "wait"]

logger = logging.getLogger(__name__)
_package_logger = logging.getLogger("fsdp2")


class _Switch:
    """The debug switch. Process-wide on purpose: it mirrors an environment variable."""

    on = False
    handler: logging.Handler | None = None


def enabled() -> bool:
    return _Switch.on


def set_debug(enabled: bool = True) -> None:
    """Turn fsdp2's debug mode on or off in this process (as ``FSDP2_DEBUG=1`` does at import).

    On: every collective fsdp2 issues is logged on the ``fsdp2`` logger at DEBUG level
    (group, collective, sizes, dtype, iteration, phase), the logger's level is set to
    DEBUG, and a stderr handler is added if no handler is configured anywhere up the
    logger tree; on CUDA the all-gather header check runs (one device sync per
    all-gather). Off: the logger's level and the handler fsdp2 added are removed again.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"set_debug: enabled must be a bool, got {enabled!r}")
    _Switch.on = enabled
    if enabled:
        _package_logger.setLevel(logging.DEBUG)
        if _Switch.handler is None and not _package_logger.hasHandlers():
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
            _package_logger.addHandler(handler)
            _Switch.handler = handler
    else:
        _package_logger.setLevel(logging.NOTSET)
        if _Switch.handler is not None:
            _package_logger.removeHandler(_Switch.handler)
            _Switch.handler = None


PHASES = ("forward", "backward", "outside forward and backward")
"""Codes 0, 1, 2 of :func:`phase` (also stored in all-gather headers)."""


def phase(root: Any) -> int:
    """Where the iteration of ``root`` (a ``RootContext`` or None) is: an index into PHASES."""
    if _compat.in_backward():
        return 1
    if root is not None and root.in_forward:
        return 0
    return 2


def describe_iteration(root: Any) -> str:
    """e.g. ``"forward of step 4"``: steps count the root's forwards from 1, as a training loop counts
    its steps (``RootContext.iteration`` counts them from 0), so "step 21" is the loop's 21st step when
    every step is one forward (with gradient accumulation, every micro-batch's forward counts)."""
    if root is None:
        return "before the first forward"
    where = PHASES[phase(root)]
    return f"{'during ' if where != PHASES[2] else ''}{where} of step {root.iteration + 1}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def log_collective(kind: str, label: str, group: dist.ProcessGroup | None, sizes: str,
                   dtype: torch.dtype, root: Any) -> None:
    """Debug mode: log one collective as it is issued."""
    if _Switch.on:
        ranks = dist.get_world_size(group) if group is not None else 1
        logger.debug("rank %d: %s %s over %d ranks: %s %s, %s", _rank(), kind, label, ranks, sizes,
                      str(dtype).removeprefix("torch."), describe_iteration(root))


def wait(work: Waitable | None, kind: str, label: str, sizes: str, root: Any) -> None:
    """``work.wait()``; if it raises (a timeout, a peer that died), say what was waited for.

    The new error has the original's type where that type takes a message (gloo and
    NCCL raise ``RuntimeError`` or its subclass ``DistBackendError``), else
    ``RuntimeError``, and chains the original (``raise ... from``).
    """
    if work is None:
        return
    try:
        work.wait()
    except Exception as e:
        message = (
            f"fsdp2: {kind} of {label} ({sizes}) failed on rank {_rank()} "
            f"{describe_iteration(root)}: {e}\nA peer rank probably did not join this collective "
            "(it raised, exited, or ran a different sequence of forwards and backwards); look for "
            "the first error among all ranks' logs"
        )
        try:
            error = type(e)(message)
        except Exception:
            error = RuntimeError(message)
        raise error from e


if os.environ.get("FSDP2_DEBUG", "") not in ("", "0"):
    set_debug(True)
