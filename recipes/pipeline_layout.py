"""The pipeline's layout: the blocks split into stages and the batch into microbatches.

Pure arithmetic on the config, checked before any process group starts: ``JobConfig`` calls
:func:`check_pipeline` when ``parallelism.pp > 1``, and ``pipeline.py`` builds the stages
from :func:`pipeline_layout`. This file sits below ``config.py``: it reads the job through
``PipelineJob``, the few sections it needs, and imports no pipelining.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .errors import ConfigError

if TYPE_CHECKING:
    from .llama.model import ModelArgs

__all__ = ["PipelineJob", "PipelineLayout", "pipeline_layout", "check_pipeline", "MIN_TORCH", "SINGLE_STAGE",
           "V_SCHEDULES"]


class PipelineJob(Protocol):
    """What the layout reads of a ``JobConfig`` (``config.py``, which calls it)."""

    parallelism: Any  # ParallelismConfig: pp, pp_schedule, pp_layers_per_stage, pp_microbatches
    training: Any  # TrainingConfig: batch_size
    model: ModelArgs  # n_layers, tie_embeddings
    validation: Any  # ValidationConfig: enable
    checkpoint: Any  # CheckpointConfig: export, initial_load_path, export_hf


MIN_TORCH = (2, 13)  # torch 2.11's pipelining sends a one-stage pipeline's first step to itself (gloo fails)
SINGLE_STAGE = ("GPipe", "1F1B")  # one stage per pipeline rank
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # exactly two stages per rank, placed in a V
# Schedules that need at least as many microbatches as stages (torch refuses fewer).
_ALL_STAGES_IN_FLIGHT = ("1F1B", "DualPipeV")


@dataclass(frozen=True)
class PipelineLayout:
    """How the blocks are split: ``num_stages`` stages of ``layers_per_stage`` blocks, ``stages_per_rank``
    on each of the ``pp`` pipeline ranks, each step's batch in ``microbatches``."""

    pp: int
    schedule: str
    stages_per_rank: int
    layers_per_stage: int
    microbatches: int

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` runs, in the order the schedule takes them."""
        if self.schedule in V_SCHEDULES:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + k * self.pp for k in range(self.stages_per_rank)]

    def layers_of(self, stage: int) -> range:
        return range(stage * self.layers_per_stage, (stage + 1) * self.layers_per_stage)


def _torch_version() -> tuple[int, int]:
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[return-value]


def pipeline_layout(config: PipelineJob) -> PipelineLayout:
    """The job's stages and microbatches; raises ConfigError naming the key and the fix.

    Pure arithmetic on the config: runs before any process group starts.
    """
    p, t, n_layers = config.parallelism, config.training, config.model.n_layers
    pp, name = p.pp, p.pp_schedule
    if config.model.tie_embeddings:
        raise ConfigError(f"parallelism.pp={pp} with model.tie_embeddings=true: the first stage's embedding and the "
                          "last stage's output cannot share one weight; set model.tie_embeddings=false or pp=1")
    for key, on in (("validation.enable", config.validation.enable), ("checkpoint.export", config.checkpoint.export),
                    ("checkpoint.initial_load_path", config.checkpoint.initial_load_path),
                    ("checkpoint.export_hf", config.checkpoint.export_hf)):
        if on:
            raise ConfigError(f"{key} is not supported with parallelism.pp > 1 yet (each rank holds only its "
                              f"stages); unset {key} or run with parallelism.pp=1")
    lps = p.pp_layers_per_stage
    if lps == 0:
        per_rank = 1 if name in SINGLE_STAGE else 2
        if n_layers % (pp * per_rank):
            raise ConfigError(f"model.n_layers ({n_layers}) cannot be split into {pp * per_rank} equal stages "
                              f"(pp={pp} x {per_rank} per rank for {name}); change model.n_layers or parallelism.pp, "
                              "or set parallelism.pp_layers_per_stage")
        lps = n_layers // (pp * per_rank)
    elif n_layers % lps or (n_layers // lps) % pp:
        raise ConfigError(f"parallelism.pp_layers_per_stage={lps} must divide model.n_layers ({n_layers}) into a "
                          f"multiple of pp={pp} stages; pick a divisor of {n_layers} whose quotient pp divides")
    per_rank = n_layers // lps // pp
    if name in SINGLE_STAGE and per_rank != 1:
        raise ConfigError(f"parallelism.pp_schedule={name} runs one stage per pipeline rank, but "
                          f"pp_layers_per_stage={lps} makes {per_rank}; set pp_layers_per_stage={n_layers // pp} "
                          "(or 0), or use a multi-stage schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble)")
    if name in V_SCHEDULES and per_rank != 2:
        raise ConfigError(f"parallelism.pp_schedule={name} needs exactly 2 stages per pipeline rank (a V), but "
                          f"pp_layers_per_stage={lps} makes {per_rank}; set pp_layers_per_stage="
                          f"{n_layers // (2 * pp) or 1} (or 0){'' if n_layers % (2 * pp) == 0 else ' and more layers'}")
    if name not in SINGLE_STAGE and per_rank < 2:
        raise ConfigError(f"parallelism.pp_schedule={name} runs several stages per pipeline rank, but "
                          f"pp_layers_per_stage={lps} makes one; set it to {n_layers // (2 * pp) or 1} (or 0), or use "
                          "GPipe or 1F1B")
    layout = PipelineLayout(pp, name, per_rank, lps, p.pp_microbatches or pp * per_rank)
    _check_microbatches(layout, t.batch_size, given=p.pp_microbatches > 0)
    if _torch_version() < MIN_TORCH:  # last: the other mistakes are named on any torch
        raise ConfigError(f"parallelism.pp={pp} needs torch {'.'.join(map(str, MIN_TORCH))} or newer (this is torch "
                          f"{torch.__version__}, whose pipelining fails on a pipeline's first step); upgrade torch "
                          "or run with parallelism.pp=1")
    return layout


def _check_microbatches(layout: PipelineLayout, batch_size: int, *, given: bool) -> None:
    m, name = layout.microbatches, layout.schedule
    source = f"parallelism.pp_microbatches={m}" if given else f"{m} microbatches (one per stage: pp_microbatches=0)"
    if batch_size % m:
        raise ConfigError(f"training.batch_size ({batch_size}) must be divisible by {source}: each microbatch has "
                          "batch_size / pp_microbatches sequences; change either")
    if name in _ALL_STAGES_IN_FLIGHT and m < layout.num_stages:
        raise ConfigError(f"parallelism.pp_schedule={name} needs at least as many microbatches as stages "
                          f"({layout.num_stages}); got {source}: raise parallelism.pp_microbatches")
    rounds = max(1, m // layout.pp)
    if name in ("Interleaved1F1B", "InterleavedZeroBubble") and m % rounds:
        raise ConfigError(f"parallelism.pp_schedule={name} runs microbatches in rounds of pp={layout.pp}: "
                          f"{source} must be a multiple of {rounds}; use a multiple of pp")


def check_pipeline(config: PipelineJob) -> None:
    """Raise ConfigError for a pipeline the job cannot run (``JobConfig`` calls it when ``pp > 1``)."""
    pipeline_layout(config)
