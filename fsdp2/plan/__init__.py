"""The planner: will a layout fit, and how fast will it step, before launch.

``estimate_memory(Layout(...), ModelBuilder(...))`` predicts one rank's peak memory from a model
built on the meta device, without a process group (fsdp2 itself runs the step, counted by
``fsdp2.memory.MemoryTracker``); ``predict_step_time(layout, model_costs(layout, builder),
HARDWARE["h100"])`` predicts a step's seconds, tokens/s and MFU on a ``Hardware`` profile;
``check_fit(argv)`` is ``python -m fsdp2.plan``'s verdict as values (the recipe's pre-flight).
``python -m fsdp2.plan`` is the command line (``_cli.py``). See docs/memory.md and
docs/planning.md.

The package reads one way, from its base ``_layout.py`` (what the planner is asked) up to the
command line ``_cli.py``; it builds on ``fsdp2.memory`` (the tracker), which never imports it.
"""

from ._calibrate import calibrate
from ._cli import NOTHING_FITS, RESERVE_DEFAULTS, FitCheck, check_fit, main
from ._cli_args import parse_bytes
from ._costs import ModelCosts, OpCost, model_costs
from ._hardware import HARDWARE, Hardware, load_hardware
from ._layout import Layout, ModelBuilder
from ._planner import MemoryEstimate, Reserve, estimate_memory
from ._steptime import StepTime, predict_step_time, ring_time

__all__ = ["estimate_memory", "MemoryEstimate", "Reserve", "Layout", "ModelBuilder", "Hardware", "HARDWARE",
           "calibrate", "load_hardware", "ModelCosts", "OpCost", "model_costs", "StepTime", "predict_step_time",
           "ring_time", "check_fit", "FitCheck", "NOTHING_FITS", "RESERVE_DEFAULTS", "main", "parse_bytes"]
