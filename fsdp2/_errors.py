"""Exception types that keep code written for torch's FSDP2 catching what it caught.

fsdp2 raises ``TypeError`` for a value of the wrong type and ``ValueError`` for a bad
value, each naming the fix. Where torch's ``fully_shard`` raises another type for the same
mistake (a ``ValueError`` for a wrong type, an ``AssertionError`` for a bad value), fsdp2
raises a class that is both, so ``except`` clauses written for either keep working.
docs/comparison.md lists the cases.
"""

from __future__ import annotations

__all__ = ["FSDPTypeError", "FSDPValueError", "FSDPOrderError"]


class FSDPTypeError(TypeError, ValueError):
    """A value of the wrong type, where torch's FSDP2 raises ``ValueError``."""


class FSDPValueError(ValueError, AssertionError):
    """A bad value, where torch's FSDP2 fails an assertion (``AssertionError``)."""


class FSDPOrderError(ValueError, TypeError):
    """``fully_shard`` on a module inside one already sharded (a child after its parent), where
    torch's FSDP2 fails with a ``TypeError`` from inside (on a mesh without axis names)."""
