"""``estimate_memory``: per-rank bytes of a layout, predicted before launch on one CPU.

Parameters, gradients and optimizer state are counted from shapes, with fsdp2's exact
padding (each parameter's dim 0 rounded up to a multiple of the shard ranks, 16-byte
aligned inside a group). Activations are measured, not guessed: the model runs forward and
backward once on fake tensors (no memory, no process group) while a dispatch mode counts
live storages; autograd's saved tensors are summed through ``saved_tensors_hooks``. A model
built with fewer blocks than the real one (identical blocks) is extrapolated block by block.
The fsdp2 buffers (unsharded groups, all-gather and reduce-scatter buffers) are then laid
over that activation curve at the points where the peak can happen.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from ._live import LiveStorages, storage_key
from ._tracker import CATEGORIES, format_bytes, format_table

__all__ = ["MemoryEstimate", "estimate_memory", "TP_SPLIT_DIMS"]

ALIGN = 16
# Megatron-style TP as in the recipe: column-wise layers split dim 0, row-wise dim 1,
# the embedding splits its rows (vocab); anything else (norms) is replicated.
TP_SPLIT_DIMS = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1, "tok_embeddings": 0}
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}


@dataclass
class MemoryEstimate:
    """Predicted bytes on one rank: by category at the peak, where the peak is, and traffic."""

    peak_bytes: int
    peak_by_category: dict[str, int]
    peak_point: str
    points: dict[str, int]  # every candidate point's total
    layout: str
    comm_bytes_per_step: int
    saved_activation_bytes_per_block: int
    gpu_memory: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_memory is None else self.peak_bytes <= self.gpu_memory

    def table(self) -> str:
        rows = [(c, format_bytes(self.peak_by_category[c])) for c in CATEGORIES]
        rows.append(("total", format_bytes(self.peak_bytes)))
        text = f"layout: {self.layout}\n" + format_table(rows, ("category", "per rank at peak"))
        text += f"\npeak at: {self.peak_point}"
        text += f"\nsaved by autograd per block: {format_bytes(self.saved_activation_bytes_per_block)}"
        text += f"\ncommunication per step per rank: {format_bytes(self.comm_bytes_per_step)}"
        if self.gpu_memory is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            text += f"\n{verdict} in {format_bytes(self.gpu_memory)} ({100 * self.peak_bytes / self.gpu_memory:.0f}%)"
        return text

    __str__ = table


@dataclass
class _Group:
    """One fsdp2 group's bytes on a rank."""

    sharded: int = 0  # original dtype
    unsharded: int = 0  # param dtype, padded and aligned (the unsharded buffer)
    slice: int = 0  # all-gather send buffer
    reduce: int = 0  # full gradients in reduce dtype (reduce-scatter send buffer)
    tensors: int = 0


def _add_param(group: _Group, name: str, p: torch.Tensor, tp: int, shard: int,
               param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
    shape = list(p.shape)
    if tp > 1 and p.dim() > 0:
        split = TP_SPLIT_DIMS.get(name.split(".")[-2] if "." in name else name)
        if split is not None:
            shape[split] = math.ceil(shape[split] / tp)
    rows = shape[0] if shape else 1
    rest = math.prod(shape[1:]) if len(shape) > 1 else 1
    chunk = math.ceil(rows / shard)
    pdtype = param_dtype if p.dtype.is_floating_point else p.dtype
    aligned = lambda n: (n + ALIGN - 1) // ALIGN * ALIGN
    group.sharded += chunk * rest * p.dtype.itemsize
    group.unsharded += aligned(chunk * shard * rest * pdtype.itemsize)
    group.slice += aligned(chunk * rest * pdtype.itemsize)
    group.reduce += chunk * shard * rest * (reduce_dtype if p.dtype.is_floating_point else p.dtype).itemsize
    group.tensors += 1


@dataclass
class _Activations:
    fwd_peak: int
    bwd_peak: int
    per_block: int  # live bytes one block adds in forward (its saved tensors and output)
    saved_per_block: int  # what autograd saved inside one block
    root_grads_early: set[str]  # root parameters whose gradients exist before the blocks' backward


def _measure_activations(model: nn.Module, batch: int, seq: int, dtype: torch.dtype,
                         activation_checkpointing: bool, loss_fn: Callable) -> _Activations:
    """One forward+backward on fake tensors; bytes above the parameters, op by op."""
    blocks = model.layers
    if activation_checkpointing:
        from torch.utils.checkpoint import checkpoint

        for block in blocks:
            block.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(block.forward)
    params = dict(model.named_parameters())
    live = LiveStorages()
    for t in [*params.values(), *model.buffers()]:
        live.add(t)
    base = live.total
    param_keys = {storage_key(p) for p in params.values()}
    early: set[str] = set()
    seen_grads: list[str] = []
    def drop_grad(name: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            seen_grads.append(name)
            p.grad = None  # gradients are fsdp2's, counted from shapes: drop them as they land
        return hook

    for name, p in params.items():
        p.register_post_accumulate_grad_hook(drop_grad(name))
    blocks[-1].register_full_backward_pre_hook(lambda *_: early.update(seen_grads))
    marks: list[int] = []
    blocks[0].register_forward_pre_hook(lambda *_: marks.append(live.total))
    blocks[0].register_forward_hook(lambda *_: marks.append(live.total))
    saved: dict[int, int] = {}
    in_block = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if in_block[0] and key is not None and key not in param_keys:
            saved[key] = t.untyped_storage().nbytes()
        return t

    blocks[0].register_forward_pre_hook(lambda *_: in_block.__setitem__(0, True))
    blocks[0].register_forward_hook(lambda *_: in_block.__setitem__(0, False))
    tokens = torch.zeros(batch, seq, dtype=torch.long)
    with live, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model(tokens), tokens)
        fwd_peak = live.peak
        live.peak = live.total
        loss.backward()
        bwd_peak = live.peak
    return _Activations(fwd_peak - base, bwd_peak - base, marks[1] - marks[0], sum(saved.values()),
                        {n for n in early if not n.startswith("layers.")})


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _check_layout(world: int, dp_replicate: int, tp: int) -> int:
    for name, value in (("world", world), ("dp_replicate", dp_replicate), ("tp", tp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if world % (dp_replicate * tp):
        raise ValueError(
            f"world ({world}) must be divisible by dp_replicate ({dp_replicate}) x tp ({tp}); "
            f"the shard axis gets world / (dp_replicate x tp) ranks"
        )
    return world // (dp_replicate * tp)


def estimate_memory(
    model: nn.Module | Callable[[], nn.Module],
    *,
    world: int,
    batch: int,
    seq: int,
    dp_replicate: int = 1,
    tp: int = 1,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
    optimizer: str = "adamw",
    num_blocks: int | None = None,
    gpu_memory: int | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _lm_loss,
) -> MemoryEstimate:
    """Predict one rank's peak memory for training ``model`` with fsdp2 on a layout.

    The model is sharded as the recipe does: each of ``model.layers`` is one group, the root
    takes the rest (kept unsharded after forward). ``batch`` is per data-parallel rank.

    Args:
        model: a module on the meta device (not modified), or a function building one.
            Its forward takes int64 tokens ``(batch, seq)``; it must have ``.layers``.
        world: total ranks; ``dp_replicate`` replicas x shard ranks x ``tp``.
        param_dtype, reduce_dtype: as ``MixedPrecisionPolicy`` (None: the parameters' dtype).
        reshard_after_forward: for the blocks (the root always keeps its parameters).
        activation_checkpointing: each block recomputes its forward in backward.
        optimizer: "adamw"/"adam" (2 states), "sgd_momentum" (1), "sgd" (0).
        num_blocks: blocks of the real model when ``model`` was built with fewer identical ones.
        gpu_memory: bytes available per rank, to say whether it fits.
        loss_fn: ``(logits, targets) -> loss``; default cross-entropy in fp32.
    """
    shard = _check_layout(world, dp_replicate, tp)
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    if isinstance(model, nn.Module):
        model = copy.deepcopy(model)  # outside the fake mode: the copy's meta tensors stay real meta
    # Non-fake inputs allowed: to_empty() of a meta module reads its (real) meta tensors.
    with FakeTensorMode(allow_non_fake_inputs=True):
        if isinstance(model, nn.Module):
            model = model.to_empty(device="cpu")
        else:
            model = model()
        if not isinstance(getattr(model, "layers", None), nn.ModuleList) or len(model.layers) == 0:
            raise ValueError("estimate_memory needs a model whose blocks are in a non-empty nn.ModuleList `.layers`")
        if tp > 1:
            _check_tp(model, tp)
        orig_dtype = next(model.parameters()).dtype
        pdtype = param_dtype or orig_dtype
        rdtype = reduce_dtype or pdtype
        n_built = len(model.layers)
        n_blocks = num_blocks or n_built
        root, block = _Group(), _Group()
        for name, p in model.named_parameters():
            if name.startswith("layers."):
                if name.startswith("layers.0."):
                    _add_param(block, name, p, tp, shard, pdtype, rdtype)
            else:
                _add_param(root, name, p, tp, shard, pdtype, rdtype)
        if pdtype != orig_dtype:  # as MixedPrecisionPolicy: the unsharded parameters in param_dtype
            for module in model.modules():
                for name, p in module._parameters.items():
                    if p is not None and p.dtype.is_floating_point:
                        module._parameters[name] = nn.Parameter(p.detach().to(pdtype), p.requires_grad)
        act = _measure_activations(model, batch, seq, pdtype, activation_checkpointing, loss_fn)
        early_root = _Group()
        for name, p in model.named_parameters():
            if name in act.root_grads_early:
                _add_param(early_root, name, p, tp, shard, pdtype, rdtype)
    extra = (n_blocks - n_built) * act.per_block
    fwd_act = (act.fwd_peak + extra) // tp
    bwd_act = (act.bwd_peak + extra) // tp
    per_block_act = act.per_block // tp

    sharded = root.sharded + n_blocks * block.sharded
    states = OPTIMIZER_STATES[optimizer] * sharded + (root.tensors + n_blocks * block.tensors) * 4
    blocks_unsharded = block.unsharded * (1 if reshard_after_forward else n_blocks)
    gather = block.slice + block.slice * shard  # send + output of the prefetch
    points = {
        "forward, loss": dict(sharded_params=sharded, optimizer_state=states,
                              unsharded_params=root.unsharded + (0 if reshard_after_forward else blocks_unsharded),
                              activations=fwd_act),
        "backward, last block": dict(sharded_params=sharded, optimizer_state=states,
                                     unsharded_params=root.unsharded + blocks_unsharded,
                                     gradients=early_root.unsharded + block.unsharded,
                                     communication=gather if reshard_after_forward else 0,
                                     activations=bwd_act),
        "backward, second-to-last block": dict(
            sharded_params=sharded, optimizer_state=states,
            unsharded_params=root.unsharded + blocks_unsharded,
            gradients=early_root.unsharded + block.unsharded + block.sharded,
            communication=(gather if reshard_after_forward else 0) + block.reduce + block.reduce // shard,
            activations=max(bwd_act - per_block_act, 0)),
        "optimizer step": dict(sharded_params=sharded, optimizer_state=states, gradients=sharded,
                               other=sharded if optimizer != "sgd" else 0),
    }
    totals = {name: sum(cats.values()) for name, cats in points.items()}
    peak_point = max(totals, key=totals.get)
    by_cat = {c: points[peak_point].get(c, 0) for c in CATEGORIES}
    layout = (f"world {world} = dp_replicate {dp_replicate} x dp_shard {shard} x tp {tp}; "
              f"{n_blocks} blocks; batch {batch} x seq {seq}; param {str(pdtype).removeprefix('torch.')}; "
              f"reshard_after_forward={reshard_after_forward}; activation_checkpointing={activation_checkpointing}")
    comm = _comm_bytes(root, block, n_blocks, shard, dp_replicate, tp, reshard_after_forward,
                       activation_checkpointing, batch, seq, model_dim=_model_dim(model), act_itemsize=pdtype.itemsize)
    notes = ["activations under tp>1 are the single-rank measurement divided by tp"] if tp > 1 else []
    return MemoryEstimate(totals[peak_point], by_cat, peak_point, totals, layout, comm,
                          act.saved_per_block, gpu_memory, notes)


def _model_dim(model: nn.Module) -> int:
    norm = getattr(model, "norm", None)
    weight = getattr(norm, "weight", None)
    return weight.shape[0] if weight is not None else 0


def _check_tp(model: nn.Module, tp: int) -> None:
    args = getattr(model, "args", None)
    if args is not None:
        heads, kv = args.n_heads, getattr(args, "kv_heads", args.n_heads)
        if heads % tp or kv % tp:
            raise ValueError(f"tp ({tp}) must divide the attention heads ({heads}) and kv heads ({kv})")


def _comm_bytes(root: _Group, block: _Group, n_blocks: int, shard: int, replicate: int, tp: int,
                reshard: bool, ac: bool, batch: int, seq: int, model_dim: int, act_itemsize: int) -> int:
    """Bytes each rank receives per step (ring collectives: (n - 1) / n of the full size)."""
    frac = lambda n: (n - 1) / n
    # The root is gathered once; blocks again in backward when resharded after forward.
    all_gather = (root.unsharded + block.unsharded * n_blocks * (2 if reshard else 1)) * frac(shard)
    reduce_scatter = (root.reduce + block.reduce * n_blocks) * frac(shard)
    all_reduce = 2 * frac(replicate) * (root.reduce + block.reduce * n_blocks) / shard
    # Sequence-parallel TP: per block 2 all-gathers + 2 reduce-scatters of (batch, seq, dim) in
    # forward, as many in backward, and the forward ones again when recomputing.
    tp_traffic = (4 * (3 if ac else 2) * n_blocks * batch * seq * model_dim * act_itemsize * frac(tp)) if tp > 1 else 0
    return int(all_gather + reduce_scatter + all_reduce + tp_traffic)
