"""What the memory planner is asked: a ``Layout`` (how the job runs) and a ``ModelBuilder`` (what it trains).

Both are frozen dataclasses checked when made, so a bad request fails with a message that
names the fix before any simulation starts. ``estimate_memory(layout, model)`` takes them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from .._api import QuantizedComm
from ..models.llama import LLAMA3, ModelArgs, Transformer

__all__ = ["Layout", "ModelBuilder", "OPTIMIZER_STATES", "SCHEDULES", "positive_int", "stages_per_rank",
           "microbatches"]

# Optimizer states per parameter element.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}
BACKENDS = ("nccl", "gloo")
SELECTIVE = (None, "op", "layer")  # Layout.selective_checkpointing


def positive_int(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{owner}.{name} must be at least 1, got {value}")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How a training job runs, for ``estimate_memory``: mesh, precision, resharding, optimizer, batch.

    ``world`` ranks = ``pp`` pipeline ranks x ``dp_replicate`` replicas x shard ranks x ``tp``;
    the shard axis (``dp_shard``) gets the rest. Change one field of a layout with ``dataclasses.replace``.

    Args:
        world: total ranks.
        batch: sequences per data-parallel rank (the ranks of one TP group share theirs).
        seq: tokens per sequence.
        dp_replicate: data-parallel replicas (HSDP); 1 is plain FSDP.
        tp: tensor-parallel degree (simulated with the model's plan, see ``ModelBuilder.tp_plan``).
        ep: expert-parallel degree, for models with ``fsdp2.models.moe`` layers: the shard axis is
            split into ``dp_shard / ep`` (efsdp, where the experts are FSDP-sharded) x ``ep`` (the
            ranks the experts are divided among, tokens sent by all-to-all), as the recipe does.
        param_dtype, reduce_dtype: as ``MixedPrecisionPolicy`` (None: the parameters' dtype;
            ``reduce_dtype`` None: ``param_dtype``).
        reshard_after_forward: for the blocks: True frees their parameters after forward (backward
            gathers them again over the shard axis), False keeps them, an int ``n`` (e.g. the GPUs of
            one node) keeps each rank's 1/n of them, so backward gathers over ``n`` ranks only (as
            ``fully_shard(reshard_after_forward=n)``): ``n`` must divide ``dp_shard``; ``dp_shard``
            means True and 1 False (normalized, as ``fully_shard`` does); not with ``tp``/``ep`` > 1
            or quantized weights. ``root_reshard_after_forward`` for the root (a bool; fsdp2's
            default keeps the root's parameters, backward needs them first).
        root_early_release: the root frees its parameters a part at a time and reduces its final
            gradients early (``FSDPModule.set_early_release(True)``); by default it keeps them all
            from forward to the end of backward and reduces there, as torch's FSDP2.
        activation_checkpointing: each block recomputes its forward in backward.
        selective_checkpointing: None, or torchtitan's selective checkpointing (activation_checkpointing
            must then be False): "op", each block saves its matmuls' outputs except every second one,
            and attention's, recomputing the rest (simulated by ``estimate_memory``); "layer", every
            second block fully checkpointed (the step-time model only: ``estimate_memory`` refuses it).
        optimizer: "adamw"/"adam" (2 states), "sgd_momentum" (1), "sgd" (0).
        grad_accum: micro-batches per step; above 1 the sharded gradients of the earlier
            ones are live during the last one's forward and backward.
        backend: "nccl" (flat collectives) or "gloo" (fsdp2's CPU transport: point-to-point
            exchanges for groups of 1 MiB and more, where all-gathers land in the unsharded
            buffer and reduce-scatters send from the gradients; gloo's flat collectives for
            smaller groups), which hold different buffers.
        cpu_reads: with ``backend="gloo"``, whether the exchanges read the peers' memory
            (ranks on one host, fsdp2's default where the kernel allows it) or send messages
            (across hosts, or ``FSDP2_CPU_COLLECTIVES=exchange``).
        comm_policy: the ``QuantizedComm`` every group is sharded with (None: unquantized): its
            quantized slices and outputs, the quantized reduction's buffers and the error-feedback
            residuals are counted (communication).
        pp: pipeline-parallel degree (``torch.distributed.pipelining``): each pipeline rank holds
            ``pp_stages_per_rank`` stages of the blocks and runs ``batch`` in ``pp_microbatches``;
            see ``fsdp2/plan/_pipeline.py`` for what is simulated and what is added.
        pp_schedule: the schedule's name as torch's ``get_schedule_class`` takes it ("1F1B",
            "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
            "DualPipeV"): how many microbatches' activations a rank holds at once.
        pp_microbatches: microbatches per batch; 0: one per stage.
        pp_stages_per_rank: stages per pipeline rank; 0: 1 for GPipe and 1F1B, else 2.
    """

    world: int
    batch: int
    seq: int
    dp_replicate: int = 1
    tp: int = 1
    ep: int = 1
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    reshard_after_forward: bool | int = True
    root_reshard_after_forward: bool = False
    root_early_release: bool = False
    activation_checkpointing: bool = False
    selective_checkpointing: str | None = None
    optimizer: str = "adamw"
    grad_accum: int = 1
    backend: str = "nccl"
    cpu_reads: bool = True
    comm_policy: QuantizedComm | None = None
    pp: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatches: int = 0
    pp_stages_per_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("world", "batch", "seq", "dp_replicate", "tp", "ep", "grad_accum", "pp"):
            positive_int("Layout", name, getattr(self, name))
        if self.world % (self.pp * self.dp_replicate * self.tp):
            pp = f"pp ({self.pp}) x " if self.pp > 1 else ""
            raise ValueError(
                f"world ({self.world}) must be divisible by {pp}dp_replicate ({self.dp_replicate}) x tp ({self.tp}); "
                f"the shard axis gets world / ({'pp x ' if pp else ''}dp_replicate x tp) ranks: change world, "
                f"{'pp, ' if pp else ''}dp_replicate or tp"
            )
        if self.dp_shard % self.ep:
            raise ValueError(f"ep ({self.ep}) must divide the shard axis (world / (dp_replicate x tp) = "
                             f"{self.dp_shard}): expert parallelism splits it into dp_shard / ep x ep ranks")
        if self.pp > 1 and self.ep > 1:
            raise ValueError(f"pp ({self.pp}) with ep ({self.ep}) is not planned yet (nor run by the recipe): "
                             "plan pipeline parallelism for a dense model, or expert parallelism with pp=1")
        if self.pp > 1:
            check_pipeline_layout(self)
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(f"Layout.{name} must be a torch.dtype or None, got {value!r}; e.g. torch.bfloat16")
            if value is not None and not value.is_floating_point:
                raise ValueError(f"Layout.{name} must be a floating-point dtype, got {value}")
        for name in ("root_reshard_after_forward", "root_early_release", "activation_checkpointing", "cpu_reads"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Layout.{name} must be True or False, got {getattr(self, name)!r}")
        if self.selective_checkpointing not in SELECTIVE:
            raise ValueError(f"Layout.selective_checkpointing must be None, 'op' or 'layer', got "
                             f"{self.selective_checkpointing!r}")
        if self.selective_checkpointing and self.activation_checkpointing:
            raise ValueError("Layout.selective_checkpointing and activation_checkpointing=True exclude each other "
                             "(full checkpointing recomputes everything): set one of them")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {self.optimizer!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {self.backend!r}")
        if self.comm_policy is not None and not isinstance(self.comm_policy, QuantizedComm):
            raise TypeError(f"Layout.comm_policy must be a fsdp2.QuantizedComm or None, got {self.comm_policy!r}")
        if self.comm_policy is not None and self.comm_policy.gradient_axes != "shard" and self.dp_replicate == 1:
            raise ValueError(f"Layout.comm_policy quantizes the replicas' all-reduce (gradient_axes="
                             f"{self.comm_policy.gradient_axes!r}), which needs dp_replicate > 1; use "
                             "gradient_axes='shard' or set dp_replicate")
        self._check_reshard()

    def _check_reshard(self) -> None:
        """``reshard_after_forward``: a bool, or an int resharding to that many ranks (normalized:
        1 is False, ``dp_shard`` True, as ``fully_shard`` resolves it)."""
        value = self.reshard_after_forward
        if isinstance(value, bool):
            return
        if not isinstance(value, int):
            raise TypeError(f"Layout.reshard_after_forward must be True, False or an int (ranks to reshard to "
                            f"after forward, e.g. the GPUs of one node), got {value!r}")
        shard = self.dp_shard
        if value < 1 or shard % value:
            divisors = [d for d in range(1, shard + 1) if shard % d == 0]
            raise ValueError(f"Layout.reshard_after_forward={value} must divide dp_shard ({shard}): the blocks "
                             f"reshard to groups of that many ranks of the shard axis; use one of {divisors} or a bool")
        if value in (1, shard):  # one rank keeping everything, or the whole shard axis
            object.__setattr__(self, "reshard_after_forward", value == shard)
            return
        for what, on in (("tp > 1", self.tp > 1), ("ep > 1", self.ep > 1),
                         ("comm_policy with quantized weights", bool(self.comm_policy and self.comm_policy.weights))):
            if on:  # fully_shard refuses the first and the last; experts over efsdp are not planned with it
                raise ValueError(f"Layout.reshard_after_forward={value} (an int) is not supported with {what}: "
                                 "use True or False")

    @property
    def dp_shard(self) -> int:
        """Ranks that shard each parameter: world / (pp x dp_replicate x tp)."""
        return self.world // (self.pp * self.dp_replicate * self.tp)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32 over (batch, seq, vocab) logits, as the recipe trains."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def tokens(batch: int, seq: int) -> torch.Tensor:
    """(batch, seq) int64 tokens."""
    return torch.zeros(batch, seq, dtype=torch.long)


@dataclass(frozen=True, kw_only=True)
class ModelBuilder:
    """The model ``estimate_memory`` simulates: how to build it, and how it is parallelised and fed.

    ``build()`` is called under ``torch.device("meta")``, so nothing is allocated whether it
    builds the model plainly or on the meta device; tensors it makes on a device it names
    (``device="cpu"``) are refused, after the fact. ``loss_fn`` and ``make_inputs`` run there
    too: none of the three may close over tensors on a real device (an op mixing them with
    the model's meta tensors fails). The model's blocks must be an ``nn.ModuleList``
    named ``layers`` (each one fsdp2 group; the root takes the rest).
    ``ModelBuilder.llama("llama3_70b")`` is the recipe's Llama (``fsdp2.models.llama``).

    Args:
        build: ``() -> nn.Module``, e.g. the model's class or ``lambda: Model(args)``.
        num_blocks: blocks of the real model when ``build`` makes fewer identical ones (at
            least 2 built); the missing ones are simulated as copies of block 0. None: as built.
        tp_plan: ``tp_plan(model, tp_mesh)`` applies tensor parallelism (``parallelize_module``)
            when the layout's ``tp > 1``; None: ``fsdp2.models.llama.tp_plan`` for that model
            (Megatron-style with sequence parallelism), required for any other.
        loss_fn: ``(output, inputs) -> loss``; default cross-entropy in fp32 on the tokens.
        make_inputs: ``(batch, seq) -> input`` on the default (meta) device; default int64 tokens.
    """

    build: Callable[[], nn.Module]
    num_blocks: int | None = None
    tp_plan: Callable[[nn.Module, DeviceMesh], None] | None = None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss
    make_inputs: Callable[[int, int], torch.Tensor] = tokens

    def __post_init__(self) -> None:
        if isinstance(self.build, nn.Module) or not callable(self.build):
            what = f"a {type(self.build).__name__} instance" if isinstance(self.build, nn.Module) else repr(self.build)
            raise TypeError(
                f"the planner's model must be a function that makes it (its class, or lambda: Model(args)), "
                f"got {what}: the planner calls it on the meta device, so nothing is allocated"
            )
        if self.num_blocks is not None:
            positive_int("ModelBuilder", "num_blocks", self.num_blocks)
        if self.tp_plan is not None and not callable(self.tp_plan):
            raise TypeError(f"ModelBuilder.tp_plan must be a function (model, tp_mesh) or None, got {self.tp_plan!r}")
        for name in ("loss_fn", "make_inputs"):
            if not callable(getattr(self, name)):
                raise TypeError(f"ModelBuilder.{name} must be a function, got {getattr(self, name)!r}")

    @classmethod
    def llama(cls, args: ModelArgs | str = "llama3_8b", built_blocks: int = 2) -> ModelBuilder:
        """The recipe's Llama of shape ``args`` (or a name in ``fsdp2.models.llama.LLAMA3``).

        Builds ``built_blocks`` of its blocks and extrapolates to ``args.n_layers``.
        """
        if isinstance(args, str):
            if args not in LLAMA3:
                raise ValueError(f"unknown Llama config {args!r}; choose one of {sorted(LLAMA3)} or pass a ModelArgs")
            args = LLAMA3[args]
        if not isinstance(args, ModelArgs):
            raise TypeError(f"ModelBuilder.llama takes a ModelArgs or a config name, got {type(args).__name__}")
        positive_int("ModelBuilder.llama", "built_blocks", built_blocks)
        built = dataclasses.replace(args, n_layers=min(built_blocks, args.n_layers))
        return cls(build=lambda: Transformer(built), num_blocks=args.n_layers)


# Pipeline schedules (torch.distributed.pipelining's) and a pipelined Layout's checks; what a
# pipeline adds to the memory is _pipeline.py's.
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
SINGLE_STAGE = ("GPipe", "1F1B")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def stages_per_rank(layout: Layout) -> int:
    """Pipeline stages one rank holds (``pp_stages_per_rank``, or its schedule's default)."""
    return layout.pp_stages_per_rank or (1 if layout.pp_schedule in SINGLE_STAGE else 2)


def microbatches(layout: Layout) -> int:
    """Microbatches each batch is split into (``pp_microbatches``, or one per stage)."""
    return layout.pp_microbatches or layout.pp * stages_per_rank(layout)


def check_pipeline_layout(layout: Layout) -> None:
    """Raise ValueError for a pipeline ``Layout`` its schedule cannot run (called when ``pp > 1``)."""
    name = layout.pp_schedule
    if name not in SCHEDULES:
        raise ValueError(f"Layout.pp_schedule={name!r} is not a schedule torch ships; choose one of "
                         f"{', '.join(SCHEDULES)}")
    for field in ("pp_microbatches", "pp_stages_per_rank"):
        value = getattr(layout, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"Layout.{field} must be an int >= 0 (0: the default), got {value!r}")
    per_rank = stages_per_rank(layout)
    if name in SINGLE_STAGE and per_rank != 1:
        raise ValueError(f"{name} runs one stage per pipeline rank, got pp_stages_per_rank={per_rank}; use 1 (or 0)")
    if name in V_SCHEDULES and per_rank != 2:
        raise ValueError(f"{name} runs exactly 2 stages per pipeline rank, got pp_stages_per_rank={per_rank}")
    if name not in SINGLE_STAGE and per_rank < 2:
        raise ValueError(f"{name} runs several stages per pipeline rank, got pp_stages_per_rank={per_rank}; use 2+")
    if layout.batch % microbatches(layout):
        raise ValueError(f"batch ({layout.batch}) must be divisible by the {microbatches(layout)} pipeline "
                         "microbatches (pp_microbatches; 0: one per stage): change batch or pp_microbatches")
