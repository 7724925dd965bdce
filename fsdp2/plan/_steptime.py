"""``predict_step_time``: one training step's seconds on a layout, from a model's costs and a hardware profile.

Arithmetic on ``ModelCosts`` (one sequence, unsharded) and a ``Hardware`` profile, no
simulation: cheap enough to rank hundreds of layouts. Per rank and micro-batch:

* compute: each op by the roofline, ``max(FLOPs / (peak x flops_efficiency), bytes /
  (bandwidth x bandwidth_efficiency))`` (a fused attention's FLOPs at ``attention_flops`` where
  the profile gives it), its FLOPs and activation bytes times the micro-batch,
  all of it over ``tp`` (tensor parallelism splits every op), plus ``op_overhead`` per op (the
  host's dispatch, which tp does not split); activation checkpointing runs every block's
  forward once more in backward (selective checkpointing: the part it recomputes).
* collectives: ring all-gather and reduce-scatter ``(n - 1) / n x bytes / bandwidth + (n - 1) x
  latency``, all-reduce twice that, all-to-all as one ring pass, each on the link its axis
  crosses (axes laid out pp, dp_replicate, dp_shard (efsdp, ep), tp from outermost to
  innermost, filling a node from the innermost: an axis of ``n`` ranks ``stride`` apart stays in
  a node when ``n x stride <= devices_per_node``).
* overlap as fsdp2 schedules it: block i+1's all-gather runs during block i's forward; in
  backward the next block's all-gather and the previous block's reduce-scatter (and HSDP's
  all-reduce) run during a block's backward (with an int ``reshard_after_forward`` ``n``, that
  all-gather is over the ``n`` consecutive ranks of the shard axis a rank resharded with, on
  the link they share: a node's when ``n x tp <= devices_per_node``). Exposed: the root's all-gather, the first
  block's, the last block's reduce-scatter and the root's (kept gathered from forward to
  backward, reduced at the end, unless ``root_early_release``). Tensor parallelism's
  collectives and expert parallelism's all-to-alls are on the critical path.
* gradient accumulation: the recipe reduces every micro-batch (no ``set_requires_gradient_sync(False)``),
  so each micro-batch is a full forward and backward with its collectives.
* pipelines: ``m`` microbatches of ``batch / m`` through ``pp`` ranks of ``v`` stages each;
  the bubble ``(pp - 1) x (F + B) / v`` (F, B: one microbatch's forward and backward on a rank),
  ``(pp - 1) x F / v`` for the zero-bubble schedules (the weight-gradient half of backward
  fills the rest); each rank's stage pays the rest (embedding and output layer) as the
  heaviest stage would; gradients reduced once after the last backward, exposed. Where ranks
  share cores (``Hardware.oversubscription`` > 1, a CPU host with more ranks than cores), the
  idle ranks' cores serve the busy ones: the step is the longer of a rank's own work and the
  schedule (with its bubble) run ``oversubscription`` times faster.
* host work besides the ops' (``Hardware.group_overhead``, ``param_overhead``; 0 on the GPU
  presets, where it runs ahead of the device): each FSDP group's hooks, per forward and
  backward, counted with its block's compute; the optimizer's and the clip's per tensor.
* the optimizer: memory-bound, the shards' bytes it reads and writes (AdamW: parameter,
  gradient and two states read, three written; the gradient-norm clip reads the gradients again),
  and its host work per parameter tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._costs import ModelCosts, OpCost
from ._hardware import Hardware
from ._layout import Layout
from ._layout import microbatches, stages_per_rank

__all__ = ["StepTime", "predict_step_time", "ring_time"]

_ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# Element bytes (in the parameters' stored dtype) the optimizer step reads and writes, with the
# gradient clip's read of the gradients.
_OPTIMIZER_ACCESSES = {"adamw": 8, "adam": 8, "sgd_momentum": 6, "sgd": 4}


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """A predicted training step on one rank, in seconds, and what it is made of.

    ``seconds = compute + recompute + exposed_comm + bubble + optimizer``.

    Attributes:
        seconds: the step.
        compute: forward and backward ops (no recomputation).
        recompute: activation checkpointing's second forward of each block.
        exposed_comm: collectives nothing overlaps (fsdp2's first and last, TP's, EP's, the
            pipeline's sends) and what overlapped ones take beyond the compute they hide behind.
        bubble: pipeline ranks idle in the schedule's warm-up and cool-down.
        optimizer: the optimizer step (and the gradient clip's read).
        tokens_per_s_per_device: the global batch's tokens per second, over the world.
        mfu: model FLOPs (forward and backward, no recomputation) per second over the world's peak.
        limit: the largest part: "compute" (with recompute), "communication", "bubble" or "optimizer".
    """

    seconds: float
    compute: float
    recompute: float
    exposed_comm: float
    bubble: float
    optimizer: float
    tokens_per_s_per_device: float
    mfu: float
    limit: str

    def summary(self) -> str:
        """Lines for the planner's "time:" section."""
        def ms(x: float) -> str:
            return f"{1e3 * x:.1f} ms"

        return (f"step {self.seconds:.3f} s; {self.tokens_per_s_per_device:,.0f} tokens/s per device; "
                f"MFU {100 * self.mfu:.1f}%; limited by {self.limit}\n"
                f"compute {ms(self.compute)}, recompute {ms(self.recompute)}, exposed communication "
                f"{ms(self.exposed_comm)}, pipeline bubble {ms(self.bubble)}, optimizer {ms(self.optimizer)}")


def ring_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """A ring all-gather or reduce-scatter of ``nbytes`` (the full size) over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


class _Links:
    """Each mesh axis's (size, stride) and the link its collectives cross."""

    def __init__(self, layout: Layout, hw: Hardware) -> None:
        tp, ep, shard, rep = layout.tp, layout.ep, layout.dp_shard, layout.dp_replicate
        # An int reshard_after_forward's groups: that many consecutive ranks of the shard axis.
        reshard = layout.reshard_after_forward
        subgroup = shard if reshard is True else (1 if reshard is False else reshard)
        self.axes = {"tp": (tp, 1), "ep": (ep, tp), "efsdp": (shard // ep, tp * ep), "dp_shard": (shard, tp),
                     "reshard": (subgroup, tp), "dp_replicate": (rep, tp * shard), "pp": (layout.pp, tp * shard * rep)}
        self.hw = hw

    def crosses(self, axis: str) -> bool:
        n, stride = self.axes[axis]
        return n > 1 and n * stride > self.hw.devices_per_node

    def link(self, axis: str) -> tuple[float, float]:
        hw = self.hw
        if self.crosses(axis):
            return hw.inter_bandwidth * hw.link_efficiency, hw.inter_latency
        return hw.intra_bandwidth * hw.link_efficiency, hw.intra_latency

    def ring(self, axis: str, nbytes: float) -> float:
        return ring_time(nbytes, self.axes[axis][0], *self.link(axis)) if nbytes else 0.0  # none: no collective

    def p2p(self, axis: str, nbytes: float) -> float:
        bandwidth, latency = self.link(axis)
        return nbytes / bandwidth + latency if self.axes[axis][0] > 1 else 0.0


def _compute(ops: tuple[OpCost, ...], batch: float, tp: int, hw: Hardware) -> float:
    flops_s, bytes_s = hw.peak_flops * hw.flops_efficiency * tp, hw.hbm_bandwidth * hw.bandwidth_efficiency * tp
    attention_s = hw.attention_flops * tp or flops_s  # (0: at the matmuls' rate)
    total = sum(max(op.flops * batch / (attention_s if op.attention else flops_s),
                    (op.act_bytes * batch + op.weight_bytes) / bytes_s) for op in ops)
    overhead = hw.dtensor_op_overhead if tp > 1 else hw.op_overhead  # tp's ops run on DTensors
    return total + len(ops) * overhead  # each op's host time (eager dispatch), not split by tp


def _wire_itemsizes(layout: Layout, costs: ModelCosts) -> tuple[float, float, float]:
    """Bytes per element all-gathered, reduce-scattered, and all-reduced across replicas."""
    gather = costs.compute_dtype.itemsize
    reduce = (layout.reduce_dtype or costs.compute_dtype).itemsize
    replicate = reduce
    policy = layout.comm_policy
    if policy is not None:  # quantized values plus one fp32 scale per block of elements
        if policy.weight_block:
            gather = policy.weight_bits / 8 + 4 / policy.weight_block
        if policy.grad_block:
            reduce = policy.grad_bits / 8 + 4 / policy.grad_block
        if policy.replicate_grad_block:
            replicate = policy.grad_bits / 8 + 4 / policy.replicate_grad_block
    return gather, reduce, replicate


@dataclass(frozen=True)
class _Comm:
    """One group's collectives per micro-batch: all-gather, reduce-scatter, HSDP all-reduce, and
    backward's all-gather again where the group reshards after forward (seconds)."""

    gather: float
    reduce: float
    all_reduce: float
    regather: float


def _fsdp(layout: Layout, costs: ModelCosts, links: _Links) -> tuple[_Comm, _Comm]:
    """(a block's, the root's) FSDP collectives."""
    gather_b, reduce_b, rep_b = _wire_itemsizes(layout, costs)
    tp, ep, shard = layout.tp, layout.ep, layout.dp_shard
    dense, experts = costs.block_params / tp, costs.expert_params / ep

    def comm(dense_numel: float, expert_numel: float, reshard: bool | int) -> _Comm:
        gather = links.ring("dp_shard", dense_numel * gather_b) + links.ring("efsdp", expert_numel * gather_b)
        if reshard is True or reshard is False:
            regather = gather if reshard else 0.0
        else:  # gathered again over the int's groups (ep is 1: the experts over them too)
            regather = links.ring("reshard", (dense_numel + expert_numel) * gather_b)
        return _Comm(gather,
                     links.ring("dp_shard", dense_numel * reduce_b) + links.ring("efsdp", expert_numel * reduce_b),
                     2 * links.ring("dp_replicate", (dense_numel / shard + expert_numel / (shard // ep)) * rep_b),
                     regather)

    return (comm(dense, experts, layout.reshard_after_forward),
            comm(costs.rest_params / tp, 0.0, layout.root_reshard_after_forward))


def _chain(n: int, compute: float, comm: float, first: float) -> float:
    """``n`` alike blocks, each computing after its collective, the next one's overlapping it:
    the first collective exposed, then the slower of the two per block."""
    return first + compute + (n - 1) * max(compute, comm) if n else 0.0


def _check(layout: Layout, costs: ModelCosts, hardware: Hardware) -> None:
    if not isinstance(layout, Layout):
        raise TypeError(f"predict_step_time: layout must be a fsdp2.plan.Layout, got {type(layout).__name__}")
    if not isinstance(costs, ModelCosts):
        raise TypeError(f"predict_step_time: costs must be model_costs(layout, builder)'s, got {type(costs).__name__}")
    if not isinstance(hardware, Hardware):
        raise TypeError(f"predict_step_time: hardware must be a fsdp2.plan.Hardware (e.g. HARDWARE['h100']), "
                        f"got {type(hardware).__name__}")
    dtype = layout.param_dtype or costs.param_dtype
    if costs.seq != layout.seq or costs.compute_dtype != dtype:
        raise ValueError(f"these costs were counted for seq {costs.seq} in {costs.compute_dtype}, the layout runs seq "
                         f"{layout.seq} in {dtype}: call model_costs(layout, builder) for it")
    if layout.tp > 1 and not costs.boundary_bytes:
        raise ValueError("tensor parallelism's collectives need the blocks' output size: the model's blocks return "
                         "no tensor model_costs could measure; use tp=1")
    if layout.pp > 1 and costs.n_blocks % (layout.pp * stages_per_rank(layout)):
        raise ValueError(f"{costs.n_blocks} blocks cannot be split into pp {layout.pp} x "
                         f"{stages_per_rank(layout)} equal stages: change pp or pp_stages_per_rank")


def predict_step_time(layout: Layout, costs: ModelCosts, hardware: Hardware) -> StepTime:
    """One optimizer step's predicted seconds on ``layout`` (see this module's docstring for the model).

    Args:
        layout: the layout (its ``seq`` and ``param_dtype`` must be those ``costs`` were counted for).
        costs: ``model_costs(layout, builder)``; shared by every layout of the same model, seq and dtype.
        hardware: a ``Hardware`` profile (``HARDWARE["h100"]``, or ``calibrate()``'s).

    Raises ValueError for a layout these costs cannot describe (another seq or dtype, a
    pipeline whose stages do not divide the blocks), TypeError for arguments of the wrong type.
    """
    _check(layout, costs, hardware)
    links = _Links(layout, hardware)
    pipelined = layout.pp > 1
    m = microbatches(layout) if pipelined else 1
    v = stages_per_rank(layout) if pipelined else 1
    batch = layout.batch / m
    blocks = costs.n_blocks // layout.pp
    tp = layout.tp
    fb, bb = (_compute(ops, batch, tp, hardware) for ops in (costs.block_forward, costs.block_backward))
    fr, br = (_compute(ops, batch, tp, hardware) for ops in (costs.rest_forward, costs.rest_backward))
    rb, share = _recompute(layout, costs, fb, batch, hardware)  # a block's recomputation, averaged over blocks
    # Each FSDP group's host work (its hooks), half in forward and half in backward (not recomputed).
    hooks = hardware.group_overhead / 2
    fb, bb, fr, br = fb + hooks, bb + hooks, fr + hooks, br + hooks
    # Per block and pass on the critical path: sequence-parallel TP's 2 all-gathers and 2
    # reduce-scatters of the block's (batch, seq, dim), EP's 2 all-to-alls of the routed rows.
    tp_pass = 4 * links.ring("tp", costs.boundary_bytes * batch)
    ep_pass = 2 * links.ring("ep", costs.dispatch_bytes * batch)
    crit_f = tp_pass + ep_pass
    crit_b = crit_f * (1 + share)
    block, root = _fsdp(layout, costs, links)
    compute_micro = blocks * (fb + bb) + fr + br
    recompute_micro = blocks * rb
    if pipelined:
        total_micro, bubble = _pipeline(layout, links, hardware, costs, m, v, blocks, (fb, bb, fr, br),
                                        (crit_f, crit_b), block, root, rb)
    else:
        total_micro, bubble = _fsdp_step(layout, blocks, (fb, bb, fr, br), (crit_f, crit_b), block, root, rb), 0.0
    accum = layout.grad_accum
    compute, recompute = accum * m * compute_micro, accum * m * recompute_micro
    exposed = accum * total_micro - compute - recompute - bubble
    optimizer = _optimizer(layout, costs, hardware)
    seconds = compute + recompute + exposed + bubble + optimizer
    sequences = layout.batch * accum * layout.dp_replicate * layout.dp_shard  # per step, all ranks
    parts = {"compute": compute + recompute, "communication": exposed, "bubble": bubble, "optimizer": optimizer}
    return StepTime(seconds=seconds, compute=compute, recompute=recompute, exposed_comm=exposed, bubble=bubble,
                    optimizer=optimizer, tokens_per_s_per_device=sequences * layout.seq / seconds / layout.world,
                    mfu=sequences * costs.model_flops / (seconds * layout.world * hardware.peak_flops),
                    limit=max(parts, key=parts.__getitem__))


def _fsdp_step(layout: Layout, blocks: int, times: tuple[float, float, float, float], crit: tuple[float, float],
               block: _Comm, root: _Comm, rb: float) -> float:
    """One micro-batch's forward and backward without pipelining (``rb``: a block's recomputation)."""
    fb, bb, fr, br = times
    crit_f, crit_b = crit
    c_f = fb + crit_f
    c_b = bb + crit_b + rb
    forward = root.gather + _chain(blocks, c_f, block.gather, block.gather) + fr
    in_flight = block.regather + block.reduce + block.all_reduce  # during one block's backward
    backward = root.regather + br + _chain(blocks, c_b, in_flight, block.regather) + block.reduce + block.all_reduce
    root_reduce = root.reduce + root.all_reduce
    if layout.root_early_release:  # reduced during the blocks' backward, where they leave room
        root_reduce = max(0.0, root_reduce - (blocks - 1) * max(0.0, c_b - in_flight))
    return forward + backward + root_reduce


def _pipeline(layout: Layout, links: _Links, hw: Hardware, costs: ModelCosts, m: int, v: int, blocks: int,
              times: tuple[float, float, float, float], crit: tuple[float, float], block: _Comm,
              root: _Comm, rb: float) -> tuple[float, float]:
    """(one step's schedule without gradient accumulation, its bubble) on the heaviest pipeline rank."""
    fb, bb, fr, br = times
    crit_f, crit_b = crit
    send = v * links.p2p("pp", costs.boundary_bytes * layout.batch / m)  # each stage's send per microbatch
    c_f, c_b = fb + crit_f, bb + crit_b + rb
    forward, backward = blocks * c_f + fr + send, blocks * c_b + br + send
    stage_f, stage_b = forward / v, backward / v
    bubble = (layout.pp - 1) * (stage_f if layout.pp_schedule in _ZERO_BUBBLE else stage_f + stage_b)
    # Ranks sharing cores: while some idle, the others run up to ``oversubscription`` times
    # faster, so the step is the longer of the ranks' own work and the schedule run that fast.
    busy = m * (forward + backward)
    bubble = max(0.0, (busy + bubble) / hw.oversubscription - busy)
    # FSDP inside the stage: gathered once per step (or per microbatch and pass when resharded:
    # backward's over an int's smaller groups), overlapped block by block; reduced once after the
    # last backward, exposed.
    def chain(gather: float) -> float:
        return gather + (blocks - 1) * max(0.0, gather - c_f)

    passes = m if layout.reshard_after_forward else 1
    gathers = passes * (chain(block.gather) + chain(block.regather)) + root.gather
    reduces = blocks * (block.reduce + block.all_reduce) + root.reduce + root.all_reduce
    return busy + bubble + gathers + reduces, bubble * layout.grad_accum


def _recompute(layout: Layout, costs: ModelCosts, fb: float, batch: float, hw: Hardware) -> tuple[float, float]:
    """(a block's recomputation in backward, averaged over the blocks; the share of its forward
    collectives repeated). Full: the whole forward. Selective "layer": every second block's
    forward (torchtitan checkpoints blocks 2, 4, ...). Selective "op" (torchtitan's policy): the
    forward's ops but the saved ones, attention and every other matmul (the 1st, 3rd, ... op
    with FLOPs in the block's recorded order); of TP's collectives the all-gathers (half) again."""
    if layout.activation_checkpointing:
        return fb, 1.0
    if layout.selective_checkpointing == "layer":
        share = (costs.n_blocks // 2) / costs.n_blocks
        return share * fb, share
    if layout.selective_checkpointing == "op":
        recomputed, matmuls = [], 0
        for op in costs.block_forward:
            if op.attention:
                continue
            if op.flops:
                matmuls += 1
                if matmuls % 2:
                    continue
            recomputed.append(op)
        return _compute(tuple(recomputed), batch, layout.tp, hw), 0.5
    return 0.0, 0.0


def _optimizer(layout: Layout, costs: ModelCosts, hw: Hardware) -> float:
    shards = layout.tp * layout.dp_shard * layout.pp
    elements = (costs.rest_params + costs.n_blocks * costs.block_params) / shards + \
        costs.n_blocks * costs.expert_params / (layout.dp_shard * layout.pp)  # experts: over efsdp x ep
    accesses = _OPTIMIZER_ACCESSES[layout.optimizer]
    # Every rank holds a shard of each of its blocks' tensors; a pipeline rank, of its stages'
    # (and, as the heaviest stage would, of the rest's).
    tensors = costs.n_blocks // layout.pp * costs.block_tensors + costs.rest_tensors
    return elements * costs.param_itemsize * accesses / (hw.hbm_bandwidth * hw.bandwidth_efficiency) + \
        tensors * hw.param_overhead
