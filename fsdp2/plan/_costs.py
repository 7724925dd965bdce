"""``model_costs``: what one pass over a model on the meta device says its step will compute and move.

The model is built on the meta device (shapes, no data) with its parameters in the layout's
compute dtype, and one sequence runs forward and backward, unsharded, under a dispatch mode
that records every aten op: its FLOPs (``torch.utils.flop_counter``'s formulas, the ones
``FlopCounterMode`` uses) and the bytes it reads and writes (its tensors' sizes, parameters
apart: they do not grow with the batch). Hooks on the blocks say whose op it is: block 0's
forward and backward are the block's costs, the rest (embedding, output layer, loss) is what
remains after every built block. Attention is one op, as a fused kernel runs it: its FLOPs by
formula, its bytes the query, key, value and output (no (seq, seq) matrix), its backward 2.5x
its forward (the kernel recomputes the scores). Everything else per rank (tensor parallelism
divides it, the batch multiplies it) is arithmetic in ``_steptime.py``; so these costs depend on
the model, the sequence length and the compute dtype only, and are cached on them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..models import moe
from ._layout import Layout, ModelBuilder

__all__ = ["OpCost", "ModelCosts", "model_costs"]

_META = torch.device("meta")


class OpCost(NamedTuple):
    """One op of one sequence: FLOPs, bytes of activations it reads and writes, bytes of parameters it reads."""

    flops: float
    act_bytes: float
    weight_bytes: float
    attention: bool = False  # a fused attention (its FLOPs halved when causal)


@dataclass(frozen=True, kw_only=True)
class ModelCosts:
    """A model's costs for one sequence of ``seq`` tokens, unsharded, at ``compute_dtype``.

    ``block_*`` are one block's (block 0; the model has ``n_blocks`` alike), ``rest_*`` the
    rest's (embedding, final norm, output layer, loss). Params are element counts; ``*_bytes``
    per sequence at the compute dtype.

    Attributes:
        seq, compute_dtype: what the costs were counted for (a layout must match them).
        n_blocks: the model's blocks (``ModelBuilder.num_blocks`` or as built).
        block_forward, block_backward, rest_forward, rest_backward: the ops, each an ``OpCost``.
        block_params: one block's parameters FSDP gathers over dp_shard (experts apart).
        expert_params: one block's routed experts' parameters (gathered over efsdp; 0: dense).
        rest_params: the root group's parameters (embedding, norm, output layer).
        block_tensors, rest_tensors: parameter tensors of one block (experts included) and of the
            rest (the optimizer's per-tensor work).
        param_dtype: the parameters' dtype as stored (sharded, and the optimizer's), what a
            layout with ``param_dtype=None`` computes in; ``param_itemsize`` its bytes.
        boundary_bytes: one block's output (what tensor parallelism's collectives and a
            pipeline's sends move, per sequence).
        dispatch_bytes: with experts, the rows one block routes (seq x top_k x dim): each
            expert-parallel all-to-all moves them.
        attention_flops: one block's attention forward FLOPs (included in ``block_forward``).
        model_flops: forward and backward FLOPs of the whole model for one sequence, as MFU counts
            them: 3 x the forward's (no recomputation, attention's backward 2x its forward).
    """

    seq: int
    compute_dtype: torch.dtype
    n_blocks: int
    block_forward: tuple[OpCost, ...]
    block_backward: tuple[OpCost, ...]
    rest_forward: tuple[OpCost, ...]
    rest_backward: tuple[OpCost, ...]
    block_params: int
    expert_params: int
    rest_params: int
    block_tensors: int
    rest_tensors: int
    param_dtype: torch.dtype
    param_itemsize: int
    boundary_bytes: int
    dispatch_bytes: int
    attention_flops: float
    model_flops: float

    @property
    def params(self) -> int:
        """The model's parameters (every block's)."""
        return self.rest_params + self.n_blocks * (self.block_params + self.expert_params)

    def flops(self, part: str) -> float:
        """Total FLOPs of ``block_forward``, ``rest_backward``, ... (one sequence)."""
        return sum(op.flops for op in getattr(self, part))


class _Recorder(TorchDispatchMode):
    """Every aten op's ``OpCost``, filed under the part running (``where``) set by the hooks."""

    def __init__(self, params: set[int]) -> None:
        super().__init__()
        self.params = params  # storages of parameters (bytes that do not grow with the batch)
        self.where = "rest_forward"
        self.ops: dict[str, list[OpCost]] = {}
        self.fused = 0  # > 0 while a fused attention op runs (its own cost is recorded)
        self.attention: dict[str, float] = {}  # attention's forward FLOPs by part, unmasked (MFU's convention)
        self.boundary = 0  # bytes of block 0's output

    def add(self, cost: OpCost) -> None:
        self.ops.setdefault(self.where, []).append(cost)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.fused or func.is_view or func._overloadpacket in _FREE:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not inputs:  # factories (empty, zeros): nothing read, the write is the consumer's
            return out
        formula = flop_counter.flop_registry.get(func._overloadpacket)
        flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
        act = weight = 0
        seen: set[int] = set()
        for t in inputs + [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]:
            key = id(t.untyped_storage())
            if key in seen:
                continue
            seen.add(key)
            nbytes = t.numel() * t.element_size()
            if key in self.params:
                weight += nbytes
            else:
                act += nbytes
        self.add(OpCost(flops, float(act), float(weight)))
        return out


# Ops that move no bytes worth counting: metadata, and autograd's bookkeeping.
_FREE = {torch.ops.aten.detach, torch.ops.aten.lift_fresh, torch.ops.aten.alias, torch.ops.aten._local_scalar_dense}


class _Attention(torch.autograd.Function):
    """A fused attention's shapes and costs on the meta device: outputs allocated, nothing computed."""

    @staticmethod
    def forward(ctx: Any, recorder: _Recorder, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                causal: bool) -> torch.Tensor:
        ctx.recorder, ctx.shapes = recorder, (q, k, v)
        batch, heads, sq, d = q.shape  # (batch, heads, seq, head_dim)
        sk, dv = k.shape[-2], v.shape[-1]
        ctx.flops = 2 * batch * heads * sq * sk * (d + dv)  # scores and the weighted sum, as if unmasked
        ctx.causal = causal
        recorder.fused += 1
        try:
            out = q.new_empty((batch, heads, sq, dv))
        finally:
            recorder.fused -= 1
        io = sum(t.numel() * t.element_size() for t in (q, k, v, out))
        # A causal kernel skips the masked half of the blocks: the executed FLOPs are half.
        recorder.add(OpCost(ctx.flops * (0.5 if causal else 1.0), float(io), 0.0, True))
        recorder.attention[recorder.where] = recorder.attention.get(recorder.where, 0.0) + ctx.flops
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        q, k, v = ctx.shapes
        recorder = ctx.recorder
        recorder.fused += 1
        try:
            grads = (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))
        finally:
            recorder.fused -= 1
        io = 2 * sum(t.numel() * t.element_size() for t in (q, k, v)) + 2 * grad.numel() * grad.element_size()
        recorder.add(OpCost(2.5 * ctx.flops * (0.5 if ctx.causal else 1.0), float(io), 0.0, True))
        return None, *grads, None


class _FusedAttention(TorchFunctionMode):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _attention(self.recorder, *args, **kwargs)
        return func(*args, **kwargs)


def _attention(recorder: _Recorder, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
               scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    if query.dim() != 4:
        raise ValueError(f"model_costs counts attention on (batch, heads, seq, head_dim) tensors, got {query.dim()}-D")
    return _Attention.apply(recorder, query, key, value, bool(is_causal))


def model_costs(layout: Layout, builder: ModelBuilder) -> ModelCosts:
    """The model's per-sequence costs for ``layout``'s sequence length and compute dtype (cached).

    Layouts that differ in anything else (mesh, batch, resharding, checkpointing, pipeline)
    share these costs: ``predict_step_time`` scales them. Takes well under a second for the
    8B preset (two blocks built); cached on (builder, seq, compute dtype), so keep one builder.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"model_costs(layout, builder): layout must be a fsdp2.plan.Layout, got "
                        f"{type(layout).__name__}")
    if not isinstance(builder, ModelBuilder):
        raise TypeError(f"model_costs(layout, builder): builder must be a fsdp2.plan.ModelBuilder, got "
                        f"{type(builder).__name__}; e.g. ModelBuilder.llama('llama3_8b')")
    return _cached(builder, layout.seq, layout.param_dtype)


@functools.lru_cache(maxsize=64)
def _cached(builder: ModelBuilder, seq: int, dtype: torch.dtype | None) -> ModelCosts:
    with _META:  # as the memory planner builds it: nothing allocated
        model = builder.build()
    if not isinstance(getattr(model, "layers", None), nn.ModuleList) or len(model.layers) == 0:
        raise ValueError("model_costs needs a model whose blocks are in a non-empty nn.ModuleList `.layers`")
    stored = next(model.parameters()).dtype
    dtype = dtype or stored
    for p in model.parameters():  # computed in the compute dtype, as MixedPrecisionPolicy casts it
        p.data = p.data.to(dtype)
    recorder = _Recorder({id(p.untyped_storage()) for p in model.parameters()})
    _hook_blocks(model, recorder)
    with _META:
        inputs = builder.make_inputs(1, seq)
    with recorder, _FusedAttention(recorder):
        output = model(inputs)
        loss = builder.loss_fn(output, inputs)
        recorder.where = "rest_backward"
        loss.backward()
    return _costs(model, builder, recorder, seq, dtype, stored)


def _hook_blocks(model: nn.Module, recorder: _Recorder) -> None:
    """File each op under its block (``block{i}_forward``/``_backward``) or the rest."""
    def at(where: str):
        def hook(*_: object) -> None:
            recorder.where = where
        return hook

    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(at(f"block{i}_forward"))
        block.register_forward_hook(at("rest_forward"))
        block.register_full_backward_pre_hook(at(f"block{i}_backward"))
        block.register_full_backward_hook(at("rest_backward"))
    model.layers[0].register_forward_hook(lambda _m, _a, out: setattr(
        recorder, "boundary", sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                                  if isinstance(t, torch.Tensor))))


def _costs(model: nn.Module, builder: ModelBuilder, recorder: _Recorder, seq: int, dtype: torch.dtype,
           stored: torch.dtype) -> ModelCosts:
    ops = recorder.ops
    built = len(model.layers)
    n_blocks = builder.num_blocks or built
    block0 = model.layers[0]
    experts = moe.moe_layers(block0)
    expert_params = sum(p.numel() for layer in experts for p in layer.experts.parameters())
    block_params = sum(p.numel() for p in block0.parameters()) - expert_params
    rest_params = sum(p.numel() for p in model.parameters()) - sum(p.numel() for b in model.layers
                                                                     for p in b.parameters())
    dim = recorder.boundary // (seq * dtype.itemsize) if recorder.boundary else 0
    dispatch = seq * experts[0].top_k * dim * dtype.itemsize if experts else 0
    # MFU counts attention unmasked, its backward 2x its forward: 3x every forward FLOP.
    def forward_flops(part: str) -> float:
        executed = ops.get(part, ())
        return sum(op.flops for op in executed if not op.attention) + recorder.attention.get(part, 0.0)

    attention = recorder.attention.get("block0_forward", 0.0)
    model_flops = 3 * (n_blocks * forward_flops("block0_forward") + forward_flops("rest_forward"))
    return ModelCosts(seq=seq, compute_dtype=dtype, n_blocks=n_blocks,
                      block_forward=tuple(ops.get("block0_forward", ())),
                      block_backward=tuple(ops.get("block0_backward", ())),
                      rest_forward=tuple(ops.get("rest_forward", ())),
                      rest_backward=tuple(ops.get("rest_backward", ())),
                      block_params=block_params, expert_params=expert_params, rest_params=rest_params,
                      block_tensors=len(list(block0.parameters())),
                      rest_tensors=len(list(model.parameters())) - sum(len(list(b.parameters())) for b in model.layers),
                      param_dtype=stored, param_itemsize=stored.itemsize, boundary_bytes=recorder.boundary,
                      dispatch_bytes=dispatch,
                      attention_flops=attention, model_flops=model_flops)

