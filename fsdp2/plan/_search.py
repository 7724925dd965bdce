"""``python -m fsdp2.plan --search``: every layout the recipe can run, the ones that fit, ranked by speed.

Three parts, each replaceable:

* ``enumerate_layouts``: the layouts fsdp2 and the recipe (``recipes/train.py``) support for a
  model, a world size and a global batch: pipeline x replicas x shards x tensor (x expert)
  ranks, activation checkpointing, resharding, micro-batch and accumulation, the pipeline
  schedule, quantized communication. Nothing the recipe's ``check_command`` refuses is emitted.
* ``FastMemory``: the planner's simulation, shared. Layouts that differ only in their shard
  and replica counts share at most two simulations (at two dp_shards): every point of the step
  is fitted as a + b / dp_shard through them; the reserve is each layout's own.
  tests/tools/test_plan_search.py holds it to each layout's own simulation.
* ``search``: every layout scored (the step-time model: ``score(layout)``, from
  ``_search_scorer.make_scorer``), then checked for memory fastest first, until ``top`` layouts
  fit. Slower layouts are never simulated; each simulation made also sizes, for free, every
  other layout that shares it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import torch

from .._api import QuantizedComm
from ..models.llama import ModelArgs
from ._layout import Layout, ModelBuilder
from ._planner import MemoryEstimate, Reserve, estimate_memory

__all__ = ["StepTimeLike", "SearchResult", "Evaluated", "FastMemory", "enumerate_layouts", "search",
           "recipe_overrides", "SCHEDULES_SEARCHED", "PIPELINE_MIN_TORCH"]

# The pipeline schedules searched: one stage per rank, and the interleaved one (two per rank).
SCHEDULES_SEARCHED = ("1F1B", "Interleaved1F1B")
# The recipe refuses pp > 1 on older torch (its pipelining sends a one-stage pipeline's first step
# to itself: recipes/pipeline.py's MIN_TORCH; fsdp2 does not import the recipes).
PIPELINE_MIN_TORCH = (2, 13)
_SHARDED = ("sharded_params", "optimizer_state")
_RECIPE_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16"}


class StepTimeLike(Protocol):
    """What the search reads of a step-time prediction (``fsdp2.plan.StepTime``)."""

    seconds: float
    tokens_per_s_per_device: float
    mfu: float
    limit: str


# ---- enumerating -------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _torch_version() -> tuple[int, int]:
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[return-value]


def _tp_degrees(model: ModelArgs, seq: int, devices_per_node: int) -> list[int]:
    """Tensor-parallel degrees the recipe runs: within a node, heads and the sequence split evenly,
    dense blocks with untied embeddings (fsdp2.models.llama.check_tp and the recipe's check_layout)."""
    if model.moe_experts or model.tie_embeddings:
        return [1]
    return [t for t in _divisors(devices_per_node) if model.n_heads % t == 0 and model.kv_heads % t == 0
            and seq % t == 0]


def _pipelines(model: ModelArgs, world: int) -> list[tuple[int, str, int, int]]:
    """(pp, schedule, stages per rank, microbatches) the recipe runs; microbatches: one per stage."""
    out = [(1, "1F1B", 0, 0)]
    if model.moe_experts or model.tie_embeddings or _torch_version() < PIPELINE_MIN_TORCH:
        return out
    for pp in _divisors(world)[1:]:
        for schedule, per_rank in zip(SCHEDULES_SEARCHED, (1, 2)):
            if model.n_layers % (pp * per_rank) == 0 and model.n_layers // (pp * per_rank) >= 1:
                out.append((pp, schedule, per_rank, pp * per_rank))
    return out


def _policies(pp: int, shard: int, replicate: int, tp: int, ep: int,
              devices_per_node: int) -> Iterable[tuple[bool, bool | int, bool, QuantizedComm | None]]:
    """(activation checkpointing, reshard blocks, reshard root, quantized communication).

    Resharding as the recipe names it: pp == 1 "default" (blocks, not the root), "never", and per
    node (the recipe's int: the blocks resharded to one node's ``devices_per_node`` ranks, the
    root kept) where the shard axis spans whole nodes (``dp_shard`` a multiple of
    ``devices_per_node`` above it: elsewhere the int is True, or splits a node), without tp or ep
    (which fully_shard and the planner do not combine with an int) and unquantized (quantized
    weights refuse it); pp > 1 "default" (none) or "always" (blocks and root). int8 weights and
    gradients only where something is sharded or replicated."""
    quantized = [None] + ([QuantizedComm(weights="int8", gradients="int8")] if shard * replicate > 1 else [])
    reshards: list[tuple[bool | int, bool]] = [(True, False), (False, False)] if pp == 1 else \
        [(False, False), (True, True)]
    per_node = pp == 1 and tp == 1 and ep == 1 and shard > devices_per_node and shard % devices_per_node == 0
    for ac in (False, True):
        for blocks, root in reshards:
            for comm in quantized:
                yield ac, blocks, root, comm
        if per_node:
            yield ac, devices_per_node, False, None


def enumerate_layouts(model: ModelArgs, *, world: int, global_batch: int, seq: int, devices_per_node: int = 8,
                      param_dtype: torch.dtype = torch.bfloat16, optimizer: str = "adamw", backend: str = "nccl",
                      max_micro_batch: int = 64) -> list[Layout]:
    """Every layout of ``world`` ranks training ``global_batch`` sequences of ``seq`` tokens per step
    that fsdp2 and the recipe run (see the module's docstring); reduce dtype fp32, as the recipe.

    Data-parallel ranks are world / (pp x tp); each takes global_batch / dp sequences per step as
    micro-batches of ``batch`` times ``grad_accum``. HSDP shards over at least 2 ranks (shard 1
    is DDP, not searched). ``reshard_after_forward`` per node (the int ``devices_per_node``) is
    searched where it differs from True: see ``_policies``.
    """
    if world < 1 or global_batch < 1 or seq < 1:
        raise ValueError(f"world ({world}), global batch ({global_batch}) and seq ({seq}) must be at least 1")
    out: list[Layout] = []
    for pp, schedule, per_rank, microbatches in _pipelines(model, world):
        pipe = dict(pp=pp, pp_schedule=schedule, pp_microbatches=microbatches,
                    pp_stages_per_rank=per_rank) if pp > 1 else {}
        for tp in _tp_degrees(model, seq, devices_per_node):
            if world % (pp * tp) or global_batch % (world // (pp * tp)):
                continue
            dp = world // (pp * tp)
            per_dp = global_batch // dp
            batches = [b for b in _divisors(per_dp) if b <= max_micro_batch and b % max(1, microbatches) == 0]
            shards = [d for d in _divisors(dp) if d > 1 or dp == 1]  # (1 of several: DDP, not searched)
            for shard, batch in itertools.product(shards, batches):
                for ep in _expert_degrees(model, shard, pp):
                    for ac, blocks, root, comm in _policies(pp, shard, dp // shard, tp, ep, devices_per_node):
                        out.append(Layout(world=world, batch=batch, seq=seq, dp_replicate=dp // shard, tp=tp, ep=ep,
                                          param_dtype=param_dtype, reduce_dtype=torch.float32,
                                          reshard_after_forward=blocks, root_reshard_after_forward=root,
                                          activation_checkpointing=ac, optimizer=optimizer,
                                          grad_accum=per_dp // batch, backend=backend, comm_policy=comm, **pipe))
    return out


def _expert_degrees(model: ModelArgs, shard: int, pp: int) -> list[int]:
    if not model.moe_experts or pp > 1:
        return [1]
    return [e for e in _divisors(shard) if model.moe_experts % e == 0]


def no_layout_reason(model: ModelArgs, *, world: int, global_batch: int, seq: int, devices_per_node: int) -> str:
    """Why ``enumerate_layouts`` found nothing, naming the fix."""
    dps = sorted({world // (pp * tp) for pp, *_ in _pipelines(model, world)
                  for tp in _tp_degrees(model, seq, devices_per_node) if world % (pp * tp) == 0})
    return (f"--global-batch {global_batch} sequences cannot be split evenly over the data-parallel ranks of any "
            f"layout of {world} ranks (world / (pp x tp): {', '.join(map(str, dps))}); give a global batch that "
            f"one of them divides, e.g. {math.lcm(*dps) if dps else world}")


# ---- memory, shared ----------------------------------------------------------------------------
def _shape(layout: Layout) -> tuple[Any, ...]:
    """What a simulation depends on besides dp_shard and dp_replicate (which it is scaled over)."""
    return (layout.world // (layout.dp_replicate * layout.dp_shard), layout.batch, layout.seq, layout.tp,
            layout.ep, layout.pp, layout.pp_schedule, layout.pp_microbatches, layout.pp_stages_per_rank,
            layout.param_dtype, layout.reduce_dtype, layout.reshard_after_forward, layout.root_reshard_after_forward,
            layout.activation_checkpointing, layout.optimizer, layout.grad_accum > 1, layout.backend,
            layout.cpu_reads, layout.comm_policy)


@dataclass
class FastMemory:
    """Needed bytes per rank for many layouts, from at most two simulations per shape (``_shape``).

    The first layout of a shape asked for is simulated, and so is the first at another dp_shard:
    their estimates are exact. Every point of the step (forward and backward of each block, the
    optimizer step, ...) then holds what is sharded, scaling as 1 / dp_shard, plus what is not:
    from the two simulations each point is fitted as a + b / dp_shard, and a layout of the shape
    at any other dp_shard gets the largest point (a pipeline's microbatches in flight and
    accumulated gradients, which do not depend on dp_shard, added as the planner adds them).
    With one simulation so far (``coarse``, or ``simulations_per_shape=1``), the categories at its
    peak are scaled instead: parameters' shards, optimizer state and (accumulating) one shard's
    worth of gradients as 1 / dp_shard, the rest kept; within 5% where tested, and the search
    drops a layout on it only when it misses by more than its margin (10%).
    A layout at a simulated dp_shard with other replicas takes that simulation's peak. The
    reserve (CUDA context, NCCL per communicator, fragmentation) is always the layout's own.
    """

    builder: ModelBuilder
    reserve: Reserve
    simulations_per_shape: int = 2
    simulations: int = 0
    _refs: dict[tuple[Any, ...], list[tuple[Layout, MemoryEstimate]]] = field(default_factory=dict)

    def floor(self, layout: Layout) -> int:
        """Bytes ``layout`` needs at least, without simulating: the reserve alone (context, NCCL)."""
        return sum(self.reserve.bytes(layout, 0).values())

    def cached(self, layout: Layout) -> bool:
        return _shape(layout) in self._refs

    def estimate(self, layout: Layout, *, coarse: bool = False) -> tuple[int, int, str]:
        """(peak bytes, needed bytes, how: "simulated", "fitted" or "scaled") for ``layout``.

        ``coarse``: settle for one simulation of the shape (scaled), where it has no second.
        """
        refs = self._refs.setdefault(_shape(layout), [])
        same = [(ref, est) for ref, est in refs if ref.dp_shard == layout.dp_shard]
        limit = 1 if coarse else self.simulations_per_shape
        if not same and len(refs) < limit:
            est = estimate_memory(layout, self.builder, reserve=self.reserve)
            refs.append((layout, est))
            self.simulations += 1
            return est.peak_bytes, est.needed_bytes, "simulated"
        if same:  # (other replicas: the same peak)
            how, peak = "simulated" if same[0][0] == layout else "fitted", same[0][1].peak_bytes
        elif len(refs) > 1:
            how, peak = "fitted", _fitted(refs, layout.dp_shard)
        else:
            how, peak = "scaled", _scaled(*refs[0], layout)
        return peak, peak + sum(self.reserve.bytes(layout, peak).values()), how


def _scaled(ref: Layout, est: MemoryEstimate, layout: Layout) -> int:
    """One simulation's peak, its parameters' shards and optimizer state rescaled to ``layout.dp_shard``."""
    ratio = ref.dp_shard / layout.dp_shard
    at_peak = sum(v * (ratio if c in _SHARDED else 1) for c, v in est.peak_by_category.items())
    if ref.grad_accum > 1:  # the earlier micro-batches' sharded gradients, one shard's worth (fp32 as the shards)
        sharded_grads = min(est.peak_by_category["gradients"], est.peak_by_category["sharded_params"])
        at_peak -= sharded_grads * (1 - ratio)
    step = est.points.get("optimizer step", 0) * ratio  # everything live then is sharded, but a few buffers
    return int(max(at_peak, step))


def _split(est: MemoryEstimate) -> tuple[dict[str, int], int]:
    """(the simulated points, what a pipeline adds to their peak: 0 without one)."""
    pipelined = [name for name in est.points if name.endswith("(pipelined)")]
    points = {k: v for k, v in est.points.items() if k not in pipelined}
    step_free = [v for k, v in points.items() if k != "optimizer step"]
    return points, (est.points[pipelined[0]] - max(step_free)) if pipelined else 0


def _fitted(refs: list[tuple[Layout, MemoryEstimate]], shard: int) -> int:
    """Each point a + b / dp_shard through the first two simulations (at two dp_shards), at ``shard``."""
    (lay1, est1), (lay2, est2) = refs[:2]
    (p1, add1), (p2, add2) = _split(est1), _split(est2)
    x1, x2, x = 1 / lay1.dp_shard, 1 / lay2.dp_shard, 1 / shard
    fitted = {k: p1[k] + (p2[k] - p1[k]) * (x - x1) / (x2 - x1) for k in p1.keys() & p2.keys()}
    step = fitted.pop("optimizer step", 0)
    return int(max(max(fitted.values()) + max(add1, add2), step))


# ---- the search ------------------------------------------------------------------------------
@dataclass
class Evaluated:
    """One layout's scores: its predicted step, and its memory where it was checked."""

    layout: Layout
    step: Any  # StepTimeLike
    peak_bytes: int | None = None
    needed_bytes: int | None = None
    how: str = "not checked"  # "simulated" (its own), "fitted" or "scaled" (from its shape's: FastMemory)
    gpu_memory: int | None = None

    @property
    def fits(self) -> bool | None:
        return None if self.needed_bytes is None or self.gpu_memory is None else self.needed_bytes <= self.gpu_memory


@dataclass
class SearchResult:
    ranked: list[Evaluated]  # the layouts that fit, fastest first (at most ``top``)
    evaluated: list[Evaluated]  # every layout, fastest first by score, memory where checked
    simulations: int
    gpu_memory: int
    memory: FastMemory

    @property
    def checked(self) -> list[Evaluated]:
        return [e for e in self.evaluated if e.needed_bytes is not None]

    def closest(self) -> tuple[Evaluated, int, bool]:
        """(the layout that misses by the least, the bytes it needs, whether that is its reserve alone):
        among those sized, else by their reserve (none was simulated: every reserve exceeds the memory)."""
        if self.checked:
            best = min(self.checked, key=lambda e: e.needed_bytes)  # type: ignore[arg-type, return-value]
            return best, best.needed_bytes, False  # type: ignore[return-value]
        best = min(self.evaluated, key=lambda e: self.memory.floor(e.layout))
        return best, self.memory.floor(best.layout), True


def _order(evaluated: list[Evaluated]) -> list[Evaluated]:
    # Fastest first; ties (equal scores) go to the layout needing fewer ranks per replica, then
    # by its description, so the order is the same on every run.
    return sorted(evaluated, key=lambda e: (-e.step.tokens_per_s_per_device, e.layout.tp, e.layout.pp,
                                            e.layout.dp_replicate, repr(e.layout)))


def search(layouts: list[Layout], *, score: Callable[[Layout], Any], memory: FastMemory, gpu_memory: int,
           top: int = 5, exhaustive: bool = False, margin: float = 0.10) -> SearchResult:
    """Score every layout, then check memory fastest first until ``top`` fit (``exhaustive``: all).

    A layout is first sized from one simulation of its shape (``FastMemory.estimate(coarse=True)``);
    one that misses by more than ``margin`` is dropped there, the others are sized from two
    (fitted: within 1% of their own simulation where tested), which decides. One whose reserve
    alone exceeds ``gpu_memory`` is not simulated. Every layout whose shape a simulation has
    already sized is sized too, at no cost.
    """
    evaluated = _order([Evaluated(layout, score(layout), gpu_memory=gpu_memory) for layout in layouts])
    ranked: list[Evaluated] = []
    for e in evaluated:
        if len(ranked) >= top and not exhaustive:
            break
        if memory.floor(e.layout) > gpu_memory:
            continue
        e.peak_bytes, e.needed_bytes, e.how = memory.estimate(e.layout, coarse=True)
        if e.needed_bytes <= gpu_memory * (1 + margin):
            e.peak_bytes, e.needed_bytes, e.how = memory.estimate(e.layout)
        if e.fits:
            ranked.append(e)
    for e in evaluated:
        if e.needed_bytes is None and memory.cached(e.layout):
            e.peak_bytes, e.needed_bytes, e.how = memory.estimate(e.layout, coarse=True)
    return SearchResult(ranked[:top], evaluated, memory.simulations, gpu_memory, memory)


# ---- the recipe's flags ------------------------------------------------------------------------
def recipe_reshard(layout: Layout) -> str | int:
    """The recipe's parallelism.reshard_after_forward for the layout's (blocks, root) resharding:
    an int where the blocks reshard to that many ranks (the root kept, as the recipe runs an int)."""
    blocks = layout.reshard_after_forward
    if not isinstance(blocks, bool):
        if layout.root_reshard_after_forward:
            raise ValueError(f"the recipe runs reshard_after_forward={blocks} (an int) with the root kept, not "
                             "resharded: set root_reshard_after_forward=False")
        return blocks
    if layout.reshard_after_forward and layout.root_reshard_after_forward:
        return "always"
    if layout.reshard_after_forward:
        return "default"  # (pp == 1: the blocks, not the root)
    return "default" if layout.pp > 1 else "never"


def recipe_overrides(layout: Layout) -> dict[str, Any]:
    """The recipe's ``section.key`` values that run ``layout`` (recipes/config.py's keys)."""
    if layout.param_dtype not in _RECIPE_PRECISION:
        raise ValueError(f"the recipe trains in fp32 or bf16 (training.mixed_precision), not {layout.param_dtype}")
    comm = layout.comm_policy
    out: dict[str, Any] = {
        "parallelism.dp_replicate": layout.dp_replicate, "parallelism.dp_shard": layout.dp_shard,
        "parallelism.tp": layout.tp, "parallelism.pp": layout.pp, "parallelism.ep": layout.ep,
        "training.batch_size": layout.batch, "training.grad_accum": layout.grad_accum,
        "training.seq_len": layout.seq, "training.mixed_precision": _RECIPE_PRECISION[layout.param_dtype],
        "training.activation_checkpoint": layout.activation_checkpointing,
        "parallelism.reshard_after_forward": recipe_reshard(layout),
        "parallelism.quantize_weights": (comm.weights or "") if comm else "",
        "parallelism.quantize_gradients": (comm.gradients or "") if comm else "",
    }
    if layout.pp > 1:
        out.update({"parallelism.pp_schedule": layout.pp_schedule,
                    "parallelism.pp_microbatches": layout.pp_microbatches,
                    "validation.enable": False})  # (the recipe does not validate under pp yet)
    return out


def recipe_flags(layout: Layout) -> list[str]:
    """``recipes/train.py`` flags for ``layout`` (the model's come from its --config or --model.* keys)."""
    return [f"--{key}={str(value).lower() if isinstance(value, bool) else value}"
            for key, value in recipe_overrides(layout).items()]


def model_overrides(model: ModelArgs) -> dict[str, Any]:
    """The recipe's --model.* keys for ``model``'s shape (what --layout-from compares)."""
    return {f"model.{f.name}": getattr(model, f.name) for f in dataclasses.fields(ModelArgs)
            if getattr(model, f.name) != getattr(ModelArgs(), f.name)}
