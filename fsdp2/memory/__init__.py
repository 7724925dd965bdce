"""Memory: a tracker of where a rank's memory went during a run.

``MemoryTracker`` measures a run: live bytes by category (``CATEGORIES``), at the peak and now,
as a ``MemoryReport``. Planning a run before launch (``estimate_memory``, ``Layout``,
``predict_step_time``, ...) is ``fsdp2.plan``'s, which builds on the tracker; the planner's names
still answer here for a while, with a DeprecationWarning that names their home.
"""

import importlib
import warnings

from ._tracker import CATEGORIES, MemoryReport, MemoryTracker

__all__ = ["CATEGORIES", "MemoryTracker", "MemoryReport"]

# Moved to fsdp2.plan (0.1.0.dev0); these names forward to it until 0.2. Resolved by name when
# asked: the tracker does not import the planner, which imports the tracker.
_MOVED_TO_PLAN = frozenset({"estimate_memory", "MemoryEstimate", "Reserve", "Layout", "ModelBuilder", "Hardware",
                            "HARDWARE", "calibrate", "load_hardware", "ModelCosts", "OpCost", "model_costs",
                            "StepTime", "predict_step_time", "ring_time"})


def __getattr__(name: str):
    if name in _MOVED_TO_PLAN:
        warnings.warn(f"fsdp2.memory.{name} moved to fsdp2.plan: use `from fsdp2.plan import {name}` "
                      "(fsdp2.memory keeps the tracker; this alias goes in 0.2)", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module("fsdp2.plan"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
