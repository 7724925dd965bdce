"""The leaf every layer may import: the state attribute's name, the shared enums.

It imports nothing of fsdp2, so nothing that imports it can close a cycle. The typed
lookup of a module's state is the runtime's (``runtime/_state.get_state``).
"""

from __future__ import annotations

from enum import Enum, auto

__all__ = ["STATE_ATTR", "ShardState", "TrainingState"]

STATE_ATTR = "_fsdp2_state"
"""Where a sharded module keeps its ``ModuleState``: in ``module.__dict__``, so that the
lookup skips ``nn.Module.__getattr__`` and nothing registers it as a submodule."""


class ShardState(Enum):
    """Where a parameter group's values are."""

    SHARDED = auto()
    """Only this rank's padded shards are live; modules hold the sharded DTensor parameters."""
    GATHERING = auto()
    """An all-gather is in flight: its send and output buffers are live; modules still hold shards."""
    UNSHARDED = auto()
    """The unsharded buffer holds the full parameters; modules hold the unsharded parameters."""
    PARTIAL = auto()
    """Resharded after forward to a smaller group: this rank also keeps 1/k of the full parameters."""


class TrainingState(Enum):
    """Where a sharded module is in the training step."""

    IDLE = auto()
    """Not inside this module's forward or a backward through it."""
    FORWARD = auto()
    """Inside forward: the group's parameters are unsharded."""
    BACKWARD = auto()
    """A backward through this module is running; parameters unsharded until post-backward."""
