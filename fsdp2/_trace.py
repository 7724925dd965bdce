"""Schedule tracing: an ordered log of what each group did, for tests and debugging.

``with record_schedule() as events:`` collects strings like ``"unshard layers.0"``
(all-gather issued), ``"reshard layers.0"``, ``"reduce_scatter layers.0"`` in the
order they happened on this rank. Nothing is recorded (and nothing costs) when no
recorder is active.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["record_schedule"]

# Active recorders. A list, not a context variable: autograd may run backward
# hooks on its own device threads, which do not inherit context variables.
_ACTIVE: list[list[str]] = []


def emit(kind: str, label: str) -> None:
    if _ACTIVE:
        event = f"{kind} {label}"
        for log in _ACTIVE:
            log.append(event)


@contextlib.contextmanager
def record_schedule() -> Iterator[list[str]]:
    log: list[str] = []
    _ACTIVE.append(log)
    try:
        yield log
    finally:
        _ACTIVE.remove(log)
