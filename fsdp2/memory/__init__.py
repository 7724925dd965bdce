"""Memory: a tracker of where a rank's memory went, and a planner of whether a layout fits.

``MemoryTracker`` measures a run; ``estimate_memory(Layout(...), ModelBuilder(...))`` predicts
one from a model built on the meta device, without a process group; ``python -m fsdp2.plan`` is
the planner's command line.
"""

from ._layout import Layout, ModelBuilder
from ._planner import MemoryEstimate, Reserve, estimate_memory
from ._tracker import CATEGORIES, MemoryReport, MemoryTracker

__all__ = ["CATEGORIES", "MemoryTracker", "MemoryReport", "estimate_memory", "MemoryEstimate", "Reserve",
           "Layout", "ModelBuilder"]
