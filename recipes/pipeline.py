"""Pipeline parallelism for the recipe: the blocks split into stages, driven by ``torch.distributed.pipelining``.

The model is split as torchtitan splits it: stage ``s`` holds blocks
``s * layers_per_stage ...`` (keeping their names, ``layers.<i>``, so checkpoints are
interchangeable with runs without pipelining), the first stage also the embedding, the last the
final norm and the output projection, whose logits the loss function takes. GPipe and 1F1B run
one stage per pipeline rank; the looped schedules (Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble) put stage ``s`` on pipeline rank ``s % pp``, and the V schedules
(ZBVZeroBubble, DualPipeV) put stages ``r`` and ``2 pp - 1 - r`` on rank ``r``.

Each rank keeps one model (a ``Transformer`` pruned to its stages' parts: the optimizer, gradient
clipping and checkpoints see it) and one ``Stage`` per stage, a module over the same submodules that
pipelining runs. Each stage is sharded as torchtitan's ``apply_fsdp`` shards it under pipelining:
every block one group, the stage the root of the rest, and by default no resharding after forward
(each microbatch's forward would gather the stage again).

Pipelining drives the stages through ``fsdp2.patch_torch()``, held from the first step to
``Pipeline.close()`` (the end of training; applying it takes a few hundred milliseconds, too much
to repeat every step): it then recognises fsdp2's modules as FSDP modules and, as for torch's
FSDP2, accumulates the microbatches' gradients unsharded and reduce-scatters once per step
(imported directly, fsdp2 would reduce per microbatch, and the zero-bubble schedules would be
refused: docs/integrations.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp2
from fsdp2 import fully_shard

from .config import ConfigError
from .data import get_batch
from .llama.model import Transformer
from .llama.parallelize import apply_activation_checkpointing, apply_compile, fsdp_kwargs, tp_plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp2.patch import PatchHandle

    from .config import JobConfig, TrainingConfig
    from .llama.parallelize import ParallelDims

__all__ = ["PipelineLayout", "pipeline_layout", "check_pipeline", "Stage", "Pipeline", "build_pipeline",
           "full_parameter_count", "describe", "MIN_TORCH", "SINGLE_STAGE", "V_SCHEDULES"]

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


def pipeline_layout(config: JobConfig) -> PipelineLayout:
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


def check_pipeline(config: JobConfig) -> None:
    """Raise ConfigError for a pipeline the job cannot run (``JobConfig`` calls it when ``pp > 1``)."""
    pipeline_layout(config)


class Stage(nn.Module):
    """One pipeline stage: the embedding (first stage), its blocks, and norm + output (last stage).

    Its submodules are the rank's model's own (same objects), so the model's parameters are the
    stages'. The rotary table is read from the model (``to_empty`` and ``init_weights`` replace it there).
    """

    def __init__(self, model: Transformer, layer_ids: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self._model = (model,)  # not a submodule: its other stages are not this stage's

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)  # (batch, seq) tokens -> (batch, seq, dim)
        rope = self._model[0].rope
        for layer in self.layers.values():
            h = layer(h, rope)  # (batch, seq, dim); seq / tp under sequence parallelism
        if self.output is not None:
            h = self.output(self.norm(h))  # (batch, seq, vocab)
        return h


class _Loss:
    """The last stage's loss per microbatch: cross-entropy in fp32, its share of the step's mean
    (divided by the microbatches and the accumulated batches: the gradients' sum is the mean's)."""

    def __init__(self, microbatches: int, grad_accum: int) -> None:
        self.scale, self.poison = 1.0 / (microbatches * grad_accum), False

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) * self.scale
        return loss * float("nan") if self.poison else loss


class Pipeline:
    """This rank's share of the pipeline: its model (for the optimizer, clipping and checkpoints),
    its stages and the schedule that runs them."""

    def __init__(self, model: Transformer, stages: list[Stage], layout: PipelineLayout, pp_mesh: DeviceMesh,
                 stage_ids: list[int], device: torch.device, grad_accum: int) -> None:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        self.model, self.stages, self.layout, self.pp_mesh = model, stages, layout, pp_mesh
        self.first, self.last = 0 in stage_ids, layout.num_stages - 1 in stage_ids
        self.loss_fn = _Loss(layout.microbatches, grad_accum)
        group = pp_mesh.get_group()
        self._patch: PatchHandle | None = None  # from the first step (inside train()'s try) to close()
        runs = [PipelineStage(stage, i, layout.num_stages, device, group=group) for i, stage in zip(stage_ids, stages)]
        cls = get_schedule_class(layout.schedule)
        # No scale_grads: it divides every .grad at the end of each schedule step, which would divide an
        # earlier accumulated batch's gradients again; the loss carries the scale instead (as torchtitan's).
        self.schedule = cls(runs[0] if layout.schedule in SINGLE_STAGE else runs,
                            n_microbatches=layout.microbatches, loss_fn=self.loss_fn, scale_grads=False)

    def close(self) -> None:
        """End the ``patch_torch()`` the pipeline runs under (torch's FSDP2 names are torch's again)."""
        if self._patch is not None:
            self._patch.undo()
            self._patch = None

    def forward_backward(self, corpus: torch.Tensor, step: int, dp_rank: int, t: TrainingConfig,
                         device: torch.device, *, poison: bool = False) -> torch.Tensor:
        """Collective: run the step's ``grad_accum`` batches through the pipeline; the step's loss on every rank.

        The last stage computes the loss; an all-reduce over the pipeline axis (the others add zero)
        gives it to every rank, so the logged mean over all ranks is the mean over data-parallel ranks.
        """
        loss_sum = torch.zeros((), device=device)
        self.loss_fn.poison = poison
        if self._patch is None:  # pipelining drives fsdp2 as torch's FSDP2 while patched (one reduction per step)
            self._patch = fsdp2.patch_torch()
        for micro in range(t.grad_accum):
            inputs, targets = get_batch(corpus, seed=t.seed, step=step, rank=dp_rank, micro=micro,
                                        batch_size=t.batch_size, seq_len=t.seq_len)
            losses: list[torch.Tensor] = []
            args = (inputs.to(device),) if self.first else ()
            kwargs = dict(target=targets.to(device), losses=losses) if self.last else {}
            self.schedule.step(*args, **kwargs)
            if losses:  # each microbatch's mean, already scaled: their sum is the batch's share
                loss_sum += torch.stack([loss.detach() for loss in losses]).sum()
        dist.all_reduce(loss_sum, group=self.pp_mesh.get_group())
        return loss_sum


def build_pipeline(config: JobConfig, dims: ParallelDims, device: torch.device) -> Pipeline:
    """Collective: this rank's stages of the model, parallelized, allocated and initialised, and the schedule.

    As ``train.build_model``: built on meta; tensor parallelism, activation checkpointing and compile
    on the whole model (names and plans as without pipelining), then pruned to this rank's stages,
    sharded stage by stage, allocated and initialised (the values do not depend on the layout).
    """
    layout = pipeline_layout(config)
    mesh = dims._built()
    with torch.device("meta"):
        model = Transformer(config.model)
    if dims.tp > 1:
        tp_plan(model, mesh["tp"])
    if config.training.activation_checkpoint:
        apply_activation_checkpointing(model)
    if config.training.compile:
        apply_compile(model)
    stage_ids = layout.stages_of(mesh["pp"].get_local_rank())
    last = layout.num_stages - 1
    # Keep the blocks' names (layers.<i>): a ModuleDict of this rank's blocks, as torchtitan does.
    model.layers = nn.ModuleDict({str(i): model.layers[i] for s in stage_ids for i in layout.layers_of(s)})
    if 0 not in stage_ids:
        model.tok_embeddings = None
    if last not in stage_ids:
        model.norm = model.output = None
    stages = [Stage(model, layout.layers_of(s), first=s == 0, last=s == last) for s in stage_ids]
    kwargs, dp_mesh = fsdp_kwargs(config, pipelined=True), dims.dp_mesh()
    for stage in stages:
        for block in stage.layers.values():
            fully_shard(block, mesh=dp_mesh, **kwargs)
        fully_shard(stage, mesh=dp_mesh, **fsdp_kwargs(config, pipelined=True, root=True))
    for stage in stages:  # each stage's own call: fsdp2 adopts the new tensors of the modules it shards
        stage.to_empty(device=device)
    model.rope = torch.empty_like(model.rope, device=device)
    model.init_weights(seed=config.training.seed)
    return Pipeline(model, stages, layout, mesh["pp"], stage_ids, device, config.training.grad_accum)


def full_parameter_count(config: JobConfig) -> tuple[int, int]:
    """(parameters, embedding parameters) of the whole model, from a meta build (no rank holds it all)."""
    with torch.device("meta"):
        model = Transformer(config.model)
    return sum(p.numel() for p in model.parameters()), model.tok_embeddings.weight.numel()


def describe(layout: PipelineLayout) -> str:
    """One line for the run's setup."""
    return (f"pipeline: {layout.schedule}, {layout.num_stages} stages of {layout.layers_per_stage} block"
            f"{'s' * (layout.layers_per_stage > 1)} ({layout.stages_per_rank} per pipeline rank), "
            f"{layout.microbatches} microbatches per batch")
