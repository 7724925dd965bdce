"""Parallelize the Llama model: degrees -> a device mesh -> TP, activation checkpointing, compile, FSDP.

``ParallelDims`` turns the degrees a user asks for (``--pp``, ``--dp-shard``, ``--dp-replicate``,
``--tp``, with -1 meaning "the rest of the world") into a validated layout and a
``DeviceMesh`` whose axes are named once here and looked up by name everywhere else.
``parallelize`` then applies the techniques in the one order that composes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp2 import MixedPrecisionPolicy, QuantizedComm, fully_shard
# The tensor-parallel plan is the model's own, in the package: the memory planner uses it too.
from fsdp2.models.llama import check_tp, tp_plan
from fsdp2.models.moe import ExpertParallelMeshes, expert_parallel_meshes

from .model import Transformer
from .moe import apply_expert_parallel, check_moe, shard_experts

if TYPE_CHECKING:
    from ..config import JobConfig

__all__ = ["ParallelDims", "parallelize", "check_layout", "check_reshard", "tp_plan", "apply_activation_checkpointing",
           "apply_compile", "apply_fsdp", "fsdp_kwargs", "comm_policy_of"]

# Mesh axis names, outermost first (torchtitan's order): pipeline stages (point-to-point only, the
# least traffic), replicas, then the ranks that shard, then tensor parallel innermost so a TP
# group is the most tightly connected ranks (one node's GPUs).
AXES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class ParallelDims:
    """Degrees of each parallelism; their product is the world size.

    At most one degree may be -1; it is inferred as world_size / (product of the others).

    Args:
        dp_replicate: data-parallel replicas (HSDP); each holds a full copy, sharded within.
        dp_shard: ranks that shard parameters, gradients and optimizer state (FSDP).
        tp: tensor-parallel degree; each block's matrices are split across these ranks.
        world_size: number of ranks in the job.
        ep: expert-parallel degree (MoE models): splits the dp_shard axis into efsdp x ep
            (``recipes/llama/moe.py``); 1: experts sharded like the rest.
        pp: pipeline-parallel degree; each pipeline rank holds its stages' share of the blocks.
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    ep: int = 1
    pp: int = 1
    mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    ep_meshes: ExpertParallelMeshes | None = field(default=None, init=False, repr=False)  # with ep > 1

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")
        shown = [name for name in AXES if name != "pp" or self.pp != 1]  # (messages name pp when it is used)
        degrees = {name: getattr(self, name) for name in AXES}
        for name, value in degrees.items():
            if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
                raise ValueError(f"parallelism.{name} must be a positive int or -1 (infer), got {value!r}")
        inferred = [name for name, value in degrees.items() if value == -1]
        if len(inferred) > 1:
            raise ValueError(
                f"only one of {', '.join(shown)} can be -1 (inferred from the world size), "
                f"got -1 for {' and '.join(inferred)}"
            )
        known = 1
        for value in degrees.values():
            known *= value if value != -1 else 1
        if inferred:
            if self.world_size % known:
                raise ValueError(
                    f"cannot infer parallelism.{inferred[0]}: the other degrees multiply to {known}, "
                    f"which does not divide the world size {self.world_size}"
                )
            setattr(self, inferred[0], self.world_size // known)
        elif known != self.world_size:
            product = " * ".join(f"{name} ({getattr(self, name)})" for name in shown)
            raise ValueError(
                f"{product} = {known}, but the world size is {self.world_size}; "
                "change a degree or set one of them to -1 to infer it"
            )

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: all but the tensor-parallel ones."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """Data-parallel index of global ``rank``; the ranks of one TP group (and of one pipeline) share it
        (and their data)."""
        return rank % (self.dp_size * self.tp) // self.tp  # the mesh is row-major: pp outermost, tp innermost

    def pp_rank(self, rank: int) -> int:
        """Pipeline index of global ``rank`` (which stages it runs)."""
        return rank // (self.dp_size * self.tp)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A DeviceMesh over all ranks, saved as ``self.mesh``.

        "dp_shard" is always an axis (it is where FSDP shards, even with one rank);
        "pp", "dp_replicate" and "tp" are added only when their degree is above 1: pure FSDP is
        ("dp_shard",), HSDP ("dp_replicate", "dp_shard"), FSDP x TP ("dp_shard", "tp"),
        and HSDP x TP all three.
        """
        if self.ep > 1:  # expert parallelism: dp_shard is efsdp x ep (recipes/llama/moe.py)
            self.ep_meshes = expert_parallel_meshes(device_type, dp_replicate=self.dp_replicate,
                                                    dp_shard=self.dp_shard, ep=self.ep, tp=self.tp)
            self.mesh = self.ep_meshes.world
            return self.mesh
        names = [n for n in AXES if n == "dp_shard" or getattr(self, n) > 1]
        self.mesh = init_device_mesh(
            device_type, tuple(getattr(self, n) for n in names), mesh_dim_names=tuple(names)
        )
        return self.mesh

    def dp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: ("dp_shard",), or ("dp_replicate", "dp_shard") for HSDP.

        Never the "tp" axis: TP has already split those weights, and FSDP shards each TP
        shard again over these ranks (a 2-D DTensor on the whole mesh).
        """
        mesh = self._built()
        if self.ep_meshes is not None:
            return self.ep_meshes.dp
        if self.dp_replicate > 1:
            return mesh["dp_replicate", "dp_shard"]
        return mesh if mesh.mesh_dim_names == ("dp_shard",) else mesh["dp_shard"]

    def _built(self) -> DeviceMesh:
        if self.mesh is None:
            raise RuntimeError("call ParallelDims.build_mesh(device_type) before using the mesh")
        return self.mesh


def parallelize(model: Transformer, dims: ParallelDims, config: JobConfig) -> Transformer:
    """Apply, in this order: tensor parallelism, activation checkpointing, compile, FSDP.

    Works on a model built on the meta device: nothing here allocates parameter storage.

    Args:
        model: the unsharded model (usually on ``meta``).
        dims: validated degrees whose ``build_mesh`` has been called.
        config: the job; reads ``training.mixed_precision``, ``training.activation_checkpoint``,
            ``training.compile``, ``parallelism.reshard_after_forward`` and ``parallelism.quantize_*``.
    """
    mesh = dims._built()
    training = config.training
    # 1. TP first: it turns weights into DTensors on the "tp" axis; FSDP must see that final
    #    layout to shard each TP shard again along the data-parallel axes.
    if dims.tp > 1:
        tp_plan(model, mesh["tp"])
    apply_expert_parallel(model, dims)  # MoE: each ep rank keeps its experts (a DTensor on "ep", as TP's)
    # 2. Activation checkpointing inside FSDP's unit: FSDP's hooks run on the block's call, so
    #    the recompute in backward runs while the block is already gathered (no second all-gather).
    if training.activation_checkpoint:
        apply_activation_checkpointing(model)
    # 3. Compile each block in place; FSDP's hooks, added next, run eagerly around its graph.
    if training.compile:
        apply_compile(model)
    # 4. FSDP last, bottom-up: each block is one all-gather/reduce-scatter group, the root
    #    takes what is left (embeddings, final norm, output).
    if config.model.moe_experts:  # the experts first: a group of their own, on their own mesh
        shard_experts(model, dims, fsdp_kwargs(config))
    apply_fsdp(model, dims.dp_mesh(), config)
    return model


def check_layout(dims: ParallelDims, config: JobConfig) -> None:
    """Raise ValueError if the model or its sequences cannot be split ``dims.tp`` ways.

    Call it before any collective, so a bad layout is one clear error, not a hang.
    """
    check_moe(dims, config)
    check_reshard(dims, config)
    if dims.tp == 1:
        return
    check_tp(config.model, dims.tp)
    seq_len = config.training.seq_len
    if seq_len % dims.tp:
        # DTensor's uneven Shard(1) collectives fail on gloo (mismatched message sizes).
        raise ValueError(
            f"sequence parallelism splits each sequence over the tp ranks: training.seq_len ({seq_len}) "
            f"must be divisible by tp ({dims.tp})"
        )


def check_reshard(dims: ParallelDims, config: JobConfig) -> None:
    """An int ``parallelism.reshard_after_forward``: groups of that many ranks of the shard axis,
    in a layout fully_shard runs it in (and the memory planner plans)."""
    p = config.parallelism
    n = p.reshard_after_forward
    if not isinstance(n, int):
        return
    if dims.dp_shard % n:
        divisors = [d for d in range(1, dims.dp_shard + 1) if dims.dp_shard % d == 0]
        raise ValueError(f"parallelism.reshard_after_forward={n} must divide dp_shard ({dims.dp_shard}): each block "
                         f"reshards to groups of that many shard ranks after forward; use one of {divisors} (e.g. "
                         "the GPUs of a node), or default, always or never")
    # (1 and dp_shard are False and True to fully_shard, which runs them with anything; the experts'
    # groups under ep > 1 shard over dp_shard / ep ranks, which an int for the whole shard axis does not fit)
    unsupported = [what for what, on in (("tp > 1", dims.tp > 1 and 1 < n < dims.dp_shard),
                                         ("ep > 1", dims.ep > 1 and n > 1),
                                         ("quantize_weights", bool(p.quantize_weights) and 1 < n < dims.dp_shard))
                   if on]
    if unsupported:
        raise ValueError(f"parallelism.reshard_after_forward={n} (an int) does not run with {unsupported[0]} yet: "
                         "use default, always or never")


def apply_activation_checkpointing(model: Transformer) -> None:
    """Wrap each block so backward recomputes its activations instead of keeping them.

    The wrapper's state-dict hooks drop its ``_checkpoint_wrapped_module.`` prefix, so
    checkpoints are interchangeable between runs with and without it.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: Transformer) -> None:
    """Compile each block in place, as torchtitan does (names and parameters are unchanged).

    ``block.compile()`` compiles the block's call, not a wrapper module, so ``fully_shard``
    applied next hooks the block itself; Dynamo does not trace ``nn.Module``'s call machinery,
    so those hooks run eagerly around the compiled forward and ``fullgraph=True`` holds. With
    activation checkpointing the checkpoint-wrapped block is compiled, recomputation included.
    All blocks share one compiled graph (same code, same shapes).
    """
    for block in model.layers:
        block.compile(fullgraph=True)


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, config: JobConfig) -> None:
    """``fully_shard`` each block, then the root, with the job's precision and resharding."""
    kwargs = fsdp_kwargs(config)
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, **kwargs)
    # For the root, None keeps the parameters gathered after forward: backward needs the
    # output layer first, so gathering it again would be wasted.
    fully_shard(model, mesh=dp_mesh, **fsdp_kwargs(config, root=True))


def fsdp_kwargs(config: JobConfig, *, pipelined: bool = False, root: bool = False) -> dict:
    """``fully_shard``'s keywords for the job: precision, resharding and communication policy.

    ``pipelined``: "default" resharding keeps every group's parameters after forward, as
    torchtitan does under pipeline parallelism: each stage runs several microbatches' forwards
    before their backwards, and resharding would gather the stage again for each of them.
    An int N reshards the blocks to N ranks after forward; ``root`` (the model's or a stage's
    own group) then reshards as "default" does.
    """
    param_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[config.training.mixed_precision]
    # Gradients are always reduced in fp32: summing many bf16 gradients loses their low bits.
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    choice = config.parallelism.reshard_after_forward
    if isinstance(choice, int):
        choice = "default" if root else choice
    reshard = {"default": False if pipelined else None, "always": True, "never": False}.get(choice, choice)
    return dict(mp_policy=mp_policy, reshard_after_forward=reshard, comm_policy=comm_policy_of(config))


def comm_policy_of(config: JobConfig) -> QuantizedComm:
    """The job's ``parallelism.quantize_*`` keys as one policy for every group ("" is None: off)."""
    p = config.parallelism
    return QuantizedComm(weights=p.quantize_weights or None, gradients=p.quantize_gradients or None,
                         block_size=p.quantize_block_size, error_feedback=p.quantize_error_feedback,
                         gradient_axes=p.quantize_gradient_axes)
