"""Memory: a tracker of where a rank's memory went, and a planner of whether a layout fits.

``MemoryTracker`` measures a run; ``estimate_memory(Layout(...), ModelBuilder(...))`` predicts
one from a model built on the meta device, without a process group; ``python -m fsdp2.plan`` is
the planner's command line. ``predict_step_time(layout, model_costs(layout, builder), HARDWARE["h100"])``
predicts a step's seconds, tokens/s and MFU from the same model on a ``Hardware`` profile.
"""

from ._costs import ModelCosts, OpCost, model_costs
from ._calibrate import calibrate
from ._hardware import HARDWARE, Hardware, load_hardware
from ._layout import Layout, ModelBuilder
from ._planner import MemoryEstimate, Reserve, estimate_memory
from ._steptime import StepTime, predict_step_time, ring_time
from ._tracker import CATEGORIES, MemoryReport, MemoryTracker

__all__ = ["CATEGORIES", "MemoryTracker", "MemoryReport", "estimate_memory", "MemoryEstimate", "Reserve",
           "Layout", "ModelBuilder", "Hardware", "HARDWARE", "calibrate", "load_hardware", "ModelCosts", "OpCost",
           "model_costs", "StepTime", "predict_step_time", "ring_time"]
