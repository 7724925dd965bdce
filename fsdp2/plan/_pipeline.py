"""Pipeline parallelism in the planner: one pipeline rank's stages, simulated, and what pipelining adds.

A pipeline rank holds ``pp_stages_per_rank`` stages of ``n_blocks / (pp x stages_per_rank)``
blocks each and runs every batch as ``pp_microbatches`` microbatches. The simulation runs fsdp2
on that rank's blocks (its data-parallel ranks: ``world / pp``) for one microbatch, with the
embedding and the output layer both counted (the first stage has one, the last the other: the
heaviest stage is bounded from above). Added on top, as pipelining under ``fsdp2.patch_torch()``
(or torch's FSDP2) runs it:

* the activations of the other microbatches in flight: each stage-microbatch whose forward has
  run and whose backward has not keeps its blocks' saved tensors. The first pipeline rank holds
  the most: all ``M`` microbatches under GPipe (``M x stages`` under LoopedBFS), ``min(M, pp)``
  under 1F1B, the interleaved warm-up ``(stages - 1) x microbatches per round + 2 (pp - 1) + 1``
  under Interleaved1F1B, ``2 pp`` under the V schedules, and ``pp - 1`` more under the
  zero-bubble ones (a weight pass runs after its input pass). Approximate for the interleaved
  and zero-bubble orders, which are torch's and change between releases.
* the stage's unsharded gradients: pipelining accumulates every microbatch's gradients unsharded
  and reduces them once, after the last backward, so the rank's full gradients (in the reduce
  dtype) are live at the step's end, besides the parameters kept gathered.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ._layout import V_SCHEDULES, ZERO_BUBBLE, Layout, ModelBuilder, microbatches, stages_per_rank

if TYPE_CHECKING:
    from ._simulate import Simulation

__all__ = ["PipelinePlan", "in_flight"]


def in_flight(layout: Layout) -> int:
    """Stage-microbatches whose activations the first pipeline rank holds at once, at most."""
    pp, per_rank, m, name = layout.pp, stages_per_rank(layout), microbatches(layout), layout.pp_schedule
    if name == "GPipe":
        n = m
    elif name == "LoopedBFS":
        n = m * per_rank
    elif name == "1F1B":
        n = min(m, pp)
    elif name in V_SCHEDULES:
        n = 2 * pp
    else:  # interleaved: rank 0's warm-up forwards, then one more before the first backward
        per_round = m // max(1, m // pp)
        n = (per_rank - 1) * per_round + 2 * (pp - 1) + 1
    if name in ZERO_BUBBLE:
        n += pp - 1
    return min(n, m * per_rank)


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """One pipeline rank of a pipelined ``Layout``: what to simulate, and what to add to it."""

    layout: Layout
    stages_per_rank: int
    blocks_per_stage: int
    microbatches: int
    stage_layout: Layout  # the rank's data-parallel ranks, one microbatch
    stage_builder: ModelBuilder  # the rank's blocks (at least the 2 the simulation builds)

    @classmethod
    def of(cls, layout: Layout, builder: ModelBuilder) -> PipelinePlan:
        per_rank, m = stages_per_rank(layout), microbatches(layout)
        if builder.num_blocks is None:
            raise ValueError("pipeline parallelism (Layout.pp > 1) needs ModelBuilder.num_blocks: the blocks "
                             "are split into stages")
        stages = layout.pp * per_rank
        if builder.num_blocks % stages:
            raise ValueError(f"{builder.num_blocks} blocks cannot be split into {stages} equal stages (pp {layout.pp} "
                             f"x {per_rank} per rank); change pp or pp_stages_per_rank")
        per_stage = builder.num_blocks // stages
        stage_layout = dataclasses.replace(layout, world=layout.world // layout.pp, batch=layout.batch // m, pp=1,
                                           pp_microbatches=0, pp_stages_per_rank=0)
        stage_builder = dataclasses.replace(builder, num_blocks=max(2, per_stage * per_rank))
        return cls(layout, per_rank, per_stage, m, stage_layout, stage_builder)

    def add(self, sim: Simulation, peak: int, by_category: dict[str, int]) -> tuple[int, dict[str, int], str]:
        """The simulated microbatch's peak plus the other microbatches in flight and the accumulated gradients."""
        extra_acts = max(0, in_flight(self.layout) - self.stages_per_rank) * self.blocks_per_stage * \
            sim.saved_per_block
        grads = sim.n_blocks * sim.block.reduce + sim.root.reduce
        out = dict(by_category)
        out["activations"] = out.get("activations", 0) + extra_acts
        out["gradients"] = out.get("gradients", 0) + grads
        point = (f"{sim.peak_point}, with {in_flight(self.layout)} stage-microbatches in flight and the "
                 "stage's unsharded gradients accumulated (pipelined)")
        return peak + extra_acts + grads, out, point

    def describe(self) -> str:
        return (f"pp {self.layout.pp} ({self.layout.pp_schedule}, {self.stages_per_rank} stage"
                f"{'s' * (self.stages_per_rank > 1)} of {self.blocks_per_stage} blocks per rank, "
                f"{self.microbatches} microbatches of {self.stage_layout.batch})")
