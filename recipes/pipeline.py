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

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp2
from fsdp2 import fully_shard

from .data import get_batch
from .llama.model import Transformer
from .llama.parallelize import apply_activation_checkpointing, apply_compile, fsdp_kwargs, tp_plan
from .pipeline_layout import MIN_TORCH, SINGLE_STAGE, V_SCHEDULES, PipelineLayout, check_pipeline, pipeline_layout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp2.patch import PatchHandle

    from .config import JobConfig, TrainingConfig
    from .llama.parallelize import ParallelDims

__all__ = ["PipelineLayout", "pipeline_layout", "check_pipeline", "Stage", "Pipeline", "build_pipeline",
           "full_parameter_count", "describe", "MIN_TORCH", "SINGLE_STAGE", "V_SCHEDULES"]

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
