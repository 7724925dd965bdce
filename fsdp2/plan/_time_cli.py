"""The step-time part of ``python -m fsdp2.plan``: ``--hardware``, ``--calibrate``, and the "time:" lines.

    python -m fsdp2.plan --config llama3_8b --world 64 --hardware h100
    python -m fsdp2.plan --calibrate this_machine.json     # measure, show, save
    python -m fsdp2.plan --config llama3_8b --world 8 --hardware this_machine.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ._costs import model_costs
from ._calibrate import calibrate
from ._hardware import HARDWARE, Hardware, load_hardware
from ._layout import ModelBuilder
from ._steptime import predict_step_time

if TYPE_CHECKING:
    from ..models.llama import ModelArgs
    from ._layout import Layout

__all__ = ["add_flags", "calibrate_command", "time_report"]


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The step-time flags, one argument group at the end of the planner's parser."""
    group = parser.add_argument_group("the step time (issue #39's model: docs/planning.md)")
    group.add_argument("--hardware", default=None, metavar=f"{{{','.join(sorted(HARDWARE))},FILE.json}}",
                       help="predict the step's time, tokens/s per device and MFU on this hardware profile "
                            "(a preset, or a JSON file --calibrate wrote)")
    group.add_argument("--calibrate", nargs="?", const="", default=None, metavar="FILE.json",
                       help="measure this machine (matmul FLOP/s, memory bandwidth, gloo collectives between "
                            "local ranks), print the profile, and save it as JSON if a file is named; no model needed")
    group.add_argument("--calibrate-world", type=int, default=2, help="ranks --calibrate spawns to time collectives")


def calibrate_command(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> str | None:
    """Run ``--calibrate`` when asked (the profile, and where it was saved, as text), else None: the
    planner goes on."""
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if args.calibrate is None:
        return None
    hardware = calibrate(world=args.calibrate_world)
    if not args.calibrate:
        return describe(hardware)
    Path(args.calibrate).write_text(hardware.to_json() + "\n")
    return f"{describe(hardware)}\nsaved to {args.calibrate} (--hardware {args.calibrate} reads it)"


def describe(hw: Hardware) -> str:
    """The profile in units people read."""
    return (f"hardware: {hw.name}\n"
            f"  compute {hw.peak_flops / 1e12:.3g} TFLOP/s (x{hw.flops_efficiency:g} reached), memory "
            f"{hw.hbm_bandwidth / 1e9:.3g} GB/s (x{hw.bandwidth_efficiency:g})\n"
            f"  {hw.devices_per_node} per node: {hw.intra_bandwidth / 1e9:.3g} GB/s, {hw.intra_latency * 1e6:.3g} us "
            f"per step inside; {hw.inter_bandwidth / 1e9:.3g} GB/s, {hw.inter_latency * 1e6:.3g} us across "
            f"(x{hw.link_efficiency:g} reached)\n"
            f"  memory {hw.memory / 2**30:.3g} GiB per device"
            + (f"\n  host overhead {hw.op_overhead * 1e6:.3g} us per op, "
               f"{hw.dtensor_op_overhead * 1e6:.3g} us on DTensors"
               if hw.op_overhead or hw.dtensor_op_overhead else ""))


def time_report(args: argparse.Namespace, model: ModelArgs, layout: Layout) -> str | None:
    """The "time:" section when ``--hardware`` is given, else None (ValueError for a profile it cannot read)."""
    if args.hardware is None:
        return None
    hardware = load_hardware(args.hardware)
    step = predict_step_time(layout, model_costs(layout, ModelBuilder.llama(model)), hardware)
    return "\n".join([f"time: on {hardware.name}, {layout.world} devices",
                      *(f"  {line}" for line in step.summary().splitlines())])
