"""``estimate_memory``: per-rank bytes of a layout, predicted before launch on one CPU.

fsdp2 itself runs the step (``_simulate.py``): the model on the meta device (shapes, no data),
a fake process group of the layout's world size, the real ``fully_shard`` and hooks, and a
``MemoryTracker`` counting live storages by category, as on a real run. No copy of the
buffer schedule is kept here. Modelled on top: the optimizer step (shards, gradients,
states and one foreach temporary), the reserve a GPU process holds besides the step, and
the bytes each rank receives per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from ._layout import Layout, ModelBuilder, positive_int
from ._pipeline import PipelinePlan
from ._quantized import wire_bytes
from ._simulate import GroupSizes, Simulation, simulate
from ..memory._tracker import CATEGORIES, format_bytes, format_table

__all__ = ["MemoryEstimate", "Reserve", "estimate_memory"]

_MiB, _GiB = 2**20, 2**30

# What each category holds at the peak, for the table (docs/memory.md says the same).
_WHAT = {
    "sharded_params": "this rank's shard of every parameter, all step long",
    "unsharded_params": "parameters gathered for the blocks being computed or prefetched",
    "gradients": "unsharded gradients being computed, and sharded ones already reduced",
    "optimizer_state": "the optimizer's state of this rank's shards (AdamW: 2 values each)",
    "activations": "what autograd saved for backward, and the outputs of the op running",
    "communication": "all-gather and reduce-scatter buffers in flight",
    "other": "the input tokens and the model's buffers (rotary tables)",
}
_WHAT_AT_STEP = {  # at the optimizer step the categories hold other things
    "gradients": "the sharded gradients the optimizer reads",
    "other": "inputs, buffers, and the optimizer's foreach temporary (one shard-sized buffer)",
}


@dataclass(frozen=True, kw_only=True)
class Reserve:
    """What a GPU process holds besides the training step's tensors, added before saying "fits".

    The simulation counts what the step allocates through torch: parameters, gradients,
    optimizer state, activations and fsdp2's buffers. A real GPU process also holds memory the
    simulation cannot see; these are stated, typical figures (not measured by fsdp2), each
    overridable (``python -m fsdp2.plan --reserve-context ... --reserve-nccl ... --fragmentation ...``).

    Args:
        context: the CUDA context, its loaded kernels and the libraries' handles and workspaces
            (cuBLAS, cuDNN), outside torch's caching allocator. Default 1 GiB: recent GPUs with
            CUDA 12's lazy module loading show about 0.5-1 GiB per process before its first tensor.
        nccl_per_group: NCCL's buffers per communicator (one per mesh axis of more than one
            rank: dp_shard, dp_replicate, tp; at least one). Default 512 MiB: ``NCCL_BUFFSIZE``
            (4 MiB) per channel and peer connection, with up to 32 channels on NVLink; NVLink
            SHARP (H100) adds more.
        fragmentation: the caching allocator keeps more than the tensors it hands out (block
            rounding, free gaps between live blocks): this fraction of the simulated peak.
            Default 0.10; ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` usually lowers it.
    """

    context: int = _GiB
    nccl_per_group: int = 512 * _MiB
    fragmentation: float = 0.10

    def __post_init__(self) -> None:
        for name in ("context", "nccl_per_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Reserve.{name} must be a number of bytes >= 0, got {value!r}")
        if not isinstance(self.fragmentation, (int, float)) or not 0 <= self.fragmentation < 1:
            raise ValueError(f"Reserve.fragmentation must be a fraction in [0, 1), got {self.fragmentation!r}")

    @classmethod
    def none(cls) -> Reserve:
        """Nothing reserved: the verdict compares the simulated peak alone (as for a CPU run)."""
        return cls(context=0, nccl_per_group=0, fragmentation=0.0)

    def bytes(self, layout: Layout, peak: int) -> dict[str, int]:
        """The reserve for ``layout`` at a simulated ``peak``, by what it is for (zeros left out)."""
        groups = max(1, sum(n > 1 for n in (layout.dp_shard, layout.dp_replicate, layout.tp, layout.ep,
                                            layout.dp_shard // layout.ep if layout.ep > 1 else 1, layout.pp)))
        out = {"CUDA context": self.context, f"NCCL ({groups} communicator{'s' * (groups > 1)})":
               groups * self.nccl_per_group, f"allocator ({100 * self.fragmentation:.0f}% of total)":
               int(self.fragmentation * peak)}
        return {name: nbytes for name, nbytes in out.items() if nbytes}


@dataclass
class MemoryEstimate:
    """Predicted bytes on one rank: by category at the peak, where the peak is, and traffic.

    ``peak_bytes`` is the simulated step (what a ``MemoryTracker`` would measure); ``reserved``
    what the process holds besides (see :class:`Reserve`); ``needed_bytes`` their sum, which
    ``fits`` compares with ``gpu_memory``.
    """

    peak_bytes: int
    peak_by_category: dict[str, int]
    peak_point: str
    points: dict[str, int]  # every candidate point's total
    layout: str
    comm_bytes_per_step: int
    saved_activation_bytes_per_block: int
    gpu_memory: int | None = None
    notes: list[str] = field(default_factory=list)
    reserved: dict[str, int] = field(default_factory=dict)

    @property
    def needed_bytes(self) -> int:
        return self.peak_bytes + sum(self.reserved.values())

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_memory is None else self.needed_bytes <= self.gpu_memory

    def table(self) -> str:
        what = {**_WHAT, **(_WHAT_AT_STEP if self.peak_point == "optimizer step" else {})}
        rows = [(c, format_bytes(self.peak_by_category[c]), what[c]) for c in CATEGORIES]
        rows.append(("total", format_bytes(self.peak_bytes), "the simulated step's peak"))
        if self.reserved:
            rows += [(f"+ {name}", format_bytes(nbytes), "reserved: " + _RESERVED_WHAT[name.split(" (")[0]])
                     for name, nbytes in self.reserved.items()]
            rows.append(("needed", format_bytes(self.needed_bytes), "total + reserved"))
        table = format_table([r[:2] for r in rows], ("category", "per rank at peak")).splitlines()
        notes = ["what", "----", *(r[2] for r in rows)]
        text = f"layout: {self.layout}\n" + "\n".join(f"{line}  {note}" for line, note in zip(table, notes))
        text += f"\npeak at: {self.peak_point}"
        text += f"\nsaved by autograd per block: {format_bytes(self.saved_activation_bytes_per_block)}"
        text += f"\ncommunication per step per rank: {format_bytes(self.comm_bytes_per_step)}"
        if self.gpu_memory is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            text += (f"\n{verdict} in {format_bytes(self.gpu_memory)}: needs {format_bytes(self.needed_bytes)} "
                     f"({100 * self.needed_bytes / self.gpu_memory:.0f}%)")
        return text

    __str__ = table


_RESERVED_WHAT = {
    "CUDA context": "CUDA context, kernels, cuBLAS/cuDNN handles",
    "NCCL": "NCCL buffers per communicator",
    "allocator": "caching allocator's fragmentation",
}


def estimate_memory(layout: Layout, model: ModelBuilder | Callable[[], nn.Module] | None = None, *,
                    gpu_memory: int | None = None, reserve: Reserve | None = None) -> MemoryEstimate:
    """Predict one rank's peak memory for training a model with fsdp2 on ``layout``.

    The model is sharded as the recipe does: each of ``model.layers`` is one group, the root
    takes the rest. fsdp2 itself runs two training steps on the meta device (nothing allocated)
    over a fake process group of ``layout.world`` ranks, as rank 0; the second step's peak
    and its split into categories are read op by op by a ``MemoryTracker``, as on a real run.

    Args:
        layout: mesh sizes, precision, resharding, optimizer, batch and sequence (``Layout``).
        model: a ``ModelBuilder``, or a function building the model (``ModelBuilder(build=model)``);
            default ``ModelBuilder.llama("llama3_8b")``, the recipe's Llama at Llama 3 8B.
        gpu_memory: bytes available per rank, to say whether it fits.
        reserve: what a GPU process holds besides the step (CUDA context, NCCL, allocator
            fragmentation; see :class:`Reserve`), added to the peak for the verdict. Default:
            ``Reserve()`` for ``backend="nccl"``, nothing for ``"gloo"`` (a CPU run);
            ``Reserve.none()`` compares the simulated peak alone.

    With ``layout.tp > 1`` the meta model is tensor-parallelised by the builder's ``tp_plan``
    first. The fake process group is this process's default one while the simulation runs,
    so there must be no other: plan before ``init_process_group`` (or with ``python -m
    fsdp2.plan``); a ``ValueError`` says so otherwise.

    A process may plan and then train: DTensor's sharding-propagation caches, which compare
    meshes by value, are emptied before and after the simulation, so the simulated mesh is not
    handed to a real one of the same shape.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"estimate_memory(layout, model): layout must be a fsdp2.plan.Layout, got "
                        f"{type(layout).__name__}; e.g. Layout(world=8, batch=1, seq=8192)")
    builder = _as_builder(model)
    if layout.selective_checkpointing == "layer":
        raise ValueError("estimate_memory does not simulate selective_checkpointing='layer' (every second block "
                         "checkpointed: it copies block 0 for the blocks it does not build); plan "
                         "activation_checkpointing=True and False for the bounds, or selective_checkpointing='op'")
    if gpu_memory is not None:
        positive_int("estimate_memory", "gpu_memory", gpu_memory)
    if reserve is None:
        reserve = Reserve() if layout.backend == "nccl" else Reserve.none()
    elif not isinstance(reserve, Reserve):
        raise TypeError(f"estimate_memory(reserve=...) takes a fsdp2.plan.Reserve, got {type(reserve).__name__}")
    # Pipelined: one pipeline rank's stages for one microbatch, then the rest added (_pipeline.py).
    pipe = PipelinePlan.of(layout, builder) if layout.pp > 1 else None
    sim = simulate(pipe.stage_layout, pipe.stage_builder) if pipe else simulate(layout, builder)
    peak, by_category, point, points = sim.peak, sim.peak_by_category, sim.peak_point, dict(sim.points)
    if pipe is not None:
        peak, by_category, point = pipe.add(sim, peak, by_category)
        points[point] = peak
    step = _optimizer_step(sim, layout.optimizer)
    points["optimizer step"] = sum(step.values())
    if sum(step.values()) > peak:
        peak, by_category, point = sum(step.values()), step, "optimizer step"
    comm = _comm_bytes(sim.root, sim.block, sim.n_blocks, pipe.stage_layout if pipe else layout,
                       model_dim=sim.model_dim, act_itemsize=sim.param_dtype.itemsize) + _moe_comm_bytes(sim, layout)
    notes = [f"tensor parallelism simulated with {'the given tp_plan' if builder.tp_plan else 'the recipe Llama plan'}"
             ] if layout.tp > 1 else []
    if pipe is not None:
        notes.append("pipelined: the heaviest stage counted with both the embedding and the output layer; the "
                     "microbatches in flight follow the schedule's order (approximate for interleaved and "
                     "zero-bubble schedules); stage-to-stage sends not counted in the traffic")
    description = _describe(layout, sim.n_blocks, sim.param_dtype) + (f"; {pipe.describe()}" if pipe else "")
    return MemoryEstimate(peak, {c: by_category.get(c, 0) for c in CATEGORIES}, point, points,
                          description, comm, sim.saved_per_block,
                          gpu_memory, notes, reserve.bytes(layout, peak))


def _moe_comm_bytes(sim: Simulation, layout: Layout) -> int:
    """MoE: the experts' all-gathers and reduce-scatters over efsdp (their own groups), and, with
    expert parallelism, the token all-to-alls: per block, the routed rows (batch x seq x top_k,
    balanced) out and back in forward, the same in backward, and forward's again when recomputing."""
    if sim.experts is None:
        return 0
    efsdp, replicate, ep = layout.dp_shard // layout.ep, layout.dp_replicate, layout.ep
    gather, reduce, all_reduce = wire_bytes(sim.experts, layout.comm_policy, efsdp, replicate)
    fsdp = (gather + reduce) * (efsdp - 1) / efsdp + gather * _regather_share(layout, efsdp) + \
        all_reduce * (replicate - 1) / replicate
    rows = layout.batch * layout.seq * sim.top_k * sim.model_dim * sim.param_dtype.itemsize
    exchanges = (6 if layout.activation_checkpointing else 4) * rows * (ep - 1) / ep
    return int(sim.n_blocks * (fsdp + exchanges))


def _as_builder(model: ModelBuilder | Callable[[], nn.Module] | None) -> ModelBuilder:
    if isinstance(model, ModelBuilder):
        return model
    return ModelBuilder.llama() if model is None else ModelBuilder(build=model)


def _describe(layout: Layout, n_blocks: int, pdtype: torch.dtype) -> str:
    pp = f"pp {layout.pp} x " if layout.pp > 1 else ""
    ep = f" (efsdp {layout.dp_shard // layout.ep} x ep {layout.ep})" if layout.ep > 1 else ""
    return (f"world {layout.world} = {pp}dp_replicate {layout.dp_replicate} x dp_shard {layout.dp_shard}{ep} "
            f"x tp {layout.tp}; "
            f"{n_blocks} blocks; batch {layout.batch} x seq {layout.seq}; param {str(pdtype).removeprefix('torch.')}; "
            f"reshard_after_forward={layout.reshard_after_forward}; "
            f"activation_checkpointing={_ac_name(layout)}")


def _ac_name(layout: Layout) -> str:
    return f"selective {layout.selective_checkpointing}" if layout.selective_checkpointing else \
        str(layout.activation_checkpointing)


def _optimizer_step(sim: Simulation, optimizer: str) -> dict[str, int]:
    """The optimizer step, modelled: the shards, their gradients, the states, what fsdp2 keeps
    between steps (error feedback's residuals: communication) and one foreach temporary the
    size of the shards (other), besides the model's buffers (the inputs are freed)."""
    out = {c: 0 for c in CATEGORIES}
    out.update(sharded_params=sim.at_end["sharded_params"], optimizer_state=sim.at_end["optimizer_state"],
               communication=sim.at_end["communication"], gradients=sim.shard_values,
               other=sim.buffers + (sim.shard_values if optimizer != "sgd" else 0))
    return out


def _regather_share(layout: Layout, shard: int) -> float:
    """The share of a block's gathered bytes each rank receives again in backward: none kept
    gathered, (n - 1) / n over the shard axis resharded fully, over the ``n`` ranks of an int."""
    reshard = layout.reshard_after_forward
    n = shard if reshard is True else (1 if reshard is False else reshard)
    return (n - 1) / n


def _comm_bytes(root: GroupSizes, block: GroupSizes, n_blocks: int, layout: Layout, model_dim: int,
                act_itemsize: int) -> int:
    """Bytes each rank receives per step (ring collectives: (n - 1) / n of the full size)."""
    def frac(n: int) -> float:
        return (n - 1) / n

    shard, replicate, tp = layout.dp_shard, layout.dp_replicate, layout.tp
    ac, batch, seq = layout.activation_checkpointing, layout.batch, layout.seq
    # The root is gathered once; blocks again in backward when resharded after forward.
    (root_g, root_r, root_a), (block_g, block_r, block_a) = (
        wire_bytes(g, layout.comm_policy, shard, replicate) for g in (root, block))
    all_gather = (root_g + block_g * n_blocks) * frac(shard) + block_g * n_blocks * _regather_share(layout, shard)
    reduce_scatter = (root_r + block_r * n_blocks) * frac(shard)
    all_reduce = frac(replicate) * (root_a + block_a * n_blocks)
    # Sequence-parallel TP: per block 2 all-gathers + 2 reduce-scatters of (batch, seq, dim) in
    # forward, as many in backward, and the forward ones again when recomputing.
    tp_traffic = (4 * (3 if ac else 2) * n_blocks * batch * seq * model_dim * act_itemsize * frac(tp)) if tp > 1 else 0
    return int(all_gather + reduce_scatter + all_reduce + tp_traffic)
