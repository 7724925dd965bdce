"""The memory planner's simulation: fsdp2 itself, run on the meta device over a fake process group.

One process plays rank 0 of the layout's world: a fake process group of ``world`` ranks
(collectives that move nothing), the model built on the meta device (shapes, no data),
tensor parallelism by the model's plan, the real ``fully_shard`` on each block and the root,
and a real optimizer. The groups then compute on meta too (``ParamGroup.compute_on_meta``): every buffer the
runtime makes is a meta tensor, whose storage has a size and no data, so the tracker counts
it as on a CPU run; attention takes the kernel the CPU would (``_meta_attention.py``). One
training step runs untracked (so the optimizer state exists and the runtime knows the forward
order it prefetches by, as from a real run's second step), then the second is counted by a
``MemoryTracker`` (the same classification a real run gets), extended with the point of the
step each op belongs to. No copy of the buffer schedule is kept: a runtime change that moves
the peak moves the plan. What is still modelled: the CPU exchange's buffers and gloo's hidden
reduce-scatter copy (``_standin.py``), the blocks not built (copies of block 0, here) and the
optimizer step (``_planner.py``).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import _compat
from ..runtime._state import get_state
from ..comm._transport import CPU_COLLECTIVES_ENV
from ..models import llama, moe
from ..runtime._fully_shard import fully_shard
from .._api import MixedPrecisionPolicy
from ._layout import Layout, ModelBuilder
from ._meta_attention import CpuAttention
from ..memory._live import LiveStorages, plain_tensors, storage_key
from ._standin import group_bytes, planned_transport
from ..memory._tracker import CATEGORIES, MemoryTracker

if TYPE_CHECKING:
    from .._format import Chunking
    from ..runtime._group import ParamGroup

__all__ = ["Simulation", "simulate"]

_OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    # foreach: the states are the same, in fewer ops (the planner's time)
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-4, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-4, foreach=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9, foreach=True),
}


@dataclass
class Simulation:
    """What one simulated step measured on rank 0 (blocks not built included)."""

    peak: int
    peak_by_category: dict[str, int]
    peak_point: str
    points: dict[str, int]
    at_end: dict[str, int]  # by category once backward is done
    shard_values: int  # bytes of every parameter's shard in its own dtype (the sharded gradients)
    buffers: int  # the model's buffers (rotary tables)
    saved_per_block: int
    root: GroupSizes
    block: GroupSizes
    n_blocks: int
    param_dtype: torch.dtype
    model_dim: int
    experts: GroupSizes | None = None  # block 0's experts' group (MoE), over efsdp
    top_k: int = 0  # experts per token (MoE)


class _Points(LiveStorages):
    """Live storages, plus bytes simulated for blocks not built (``offset``), with each point's peak."""

    def __init__(self, tracker: _PlanTracker, **kwargs) -> None:
        super().__init__(**kwargs)
        self.tracker = tracker
        self.points: dict[str, int] = {}

    def check_peak(self) -> None:
        if self._resizable is not None:
            self.refresh(self._resizable())
        now = self.total + self.offset
        where = self.tracker.where()
        if now > self.points.get(where, -1):
            self.points[where] = now
        if now > self.peak:
            self.peak = now
            self._on_peak()


class _PlanTracker(MemoryTracker):
    """``MemoryTracker`` that also names the point of the step (``where``) and adds the bytes of
    blocks not built (``extra``)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(model, optimizer)
        self._live = _Points(self, on_peak=self._snapshot_peak, resizable=self._resizable)
        self._live.tag = self._birth_label
        self.extra = {c: 0 for c in CATEGORIES}
        self.at = "outside"
        self._storages: list[torch.UntypedStorage] | None = None
        self._kept: tuple[list[int], list[int]] | None = None  # the shards' and optimizer state's keys

    def _groups(self) -> list[ParamGroup]:
        # Read at every op; the planner's model keeps its groups: found once.
        if not hasattr(self, "_found"):
            self._found = super()._groups()
        return self._found

    def _resizable(self) -> list[torch.UntypedStorage]:
        # Read at every op. Only the unsharded buffers are resized in place, and they are kept
        # from step to step: found again at fsdp2's events only (their sizes are re-read at every
        # op). Holding communication buffers here would keep them alive.
        if self._storages is None:
            self._storages = [t.untyped_storage() for g in self._groups() for t in g.held_tensors()["unsharded_params"]]
        return self._storages

    def _on_event(self, event: str) -> None:
        self._storages = None
        super()._on_event(event)

    def _roles(self) -> dict[int, str]:
        # Read at every new peak: as ``MemoryTracker._roles``, with the shards and the optimizer's
        # state looked up once. They are the same tensors all the counted step (no optimizer step
        # runs in it; alive, so no other storage takes their keys); the rest changes op by op.
        if self._kept is None:
            groups = self._groups()
            self._kept = (_keys(p.padded_local for g in groups for p in g.params),
                          _keys(t for state in self.optimizer.state.values() for t in state.values()))
        sharded, states = self._kept
        roles = dict.fromkeys(sharded, "sharded_params")
        managed: set[int] = set()
        for g in self._groups():
            held = g.held_tensors()
            for category in ("gradients", "unsharded_params", "communication"):
                for key in _keys(held[category]):
                    roles.setdefault(key, category)
            for p in g.params:
                managed.update((id(p.sharded), id(p.unsharded)))
        for p in self.model.parameters():
            if id(p) not in managed:  # not sharded by fsdp2: a full copy on every rank
                for key in _keys([p.grad]):
                    roles.setdefault(key, "gradients")
                for key in _keys([p]):
                    roles.setdefault(key, "unsharded_params")
        for key in states:
            roles.setdefault(key, "optimizer_state")
        return roles

    def where(self) -> str:
        # The loss's own backward runs before the root's pre-backward hook.
        return "backward, loss" if self.at == "loss" and _compat.in_backward() else self.at

    def add_bytes(self, category: str, nbytes: int) -> None:
        self.extra[category] += nbytes
        self._live.offset += nbytes
        self._live.check_peak()

    def by_category(self) -> dict[str, int]:
        out = super()._by_category()
        return {c: out[c] + self.extra[c] for c in CATEGORIES}

    _by_category = by_category

    def _snapshot_peak(self) -> None:
        self._peak = (self._by_category(), self.where(), {})


def _keys(tensors: Iterable[object]) -> list[int]:
    """The storage keys behind the tensors among ``tensors`` (a DTensor's local one), in order."""
    return [key for t in tensors if isinstance(t, torch.Tensor)
            for plain in plain_tensors(t) if (key := storage_key(plain)) is not None]


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def simulate(layout: Layout, builder: ModelBuilder) -> Simulation:
    """Rank 0's second training step of ``builder``'s model on ``layout``, on the meta device."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_compat.fake_process_group(layout.world))
        mesh, dp_mesh, experts_mesh = _meshes(layout)
        attention = stack.enter_context(CpuAttention())  # attention's kernel as the CPU picks it, not meta's
        with _environ(CPU_COLLECTIVES_ENV, "flat"):  # no real exchange is ever built (nor probed)
            model = _build(builder, layout, mesh["tp"] if layout.tp > 1 else None, attention)
            if layout.ep > 1:
                moe.enable_expert_parallel(model, mesh["ep"])
            n_built = len(model.layers)
            n_blocks = builder.num_blocks or n_built
            if n_blocks < n_built or (n_blocks > n_built and n_built < 2):
                raise ValueError(f"num_blocks ({n_blocks}) needs a model built with at least 2 and at most "
                                 f"num_blocks blocks; it has {n_built}")
            pdtype = layout.param_dtype or next(model.parameters()).dtype
            _shard(model, layout, dp_mesh, experts_mesh)
            groups = _groups(model)
            for group in groups:
                group.compute_on_meta()
            opt = _OPTIMIZERS[layout.optimizer](list(model.parameters()))
            _step(model, builder, layout, opt)  # the first step: optimizer state, forward order
        for group in groups:  # the transport a real run picks (FSDP2_CPU_COLLECTIVES as set), or its stand-in
            group.transport = planned_transport(group, layout.backend == "gloo", layout.cpu_reads)
            group.refresh_transports()
        transports = [g.transport for g in groups]
        result = _tracked_step(model, builder, layout, opt, n_blocks - n_built)
        if [g.transport for g in groups] != transports:
            raise RuntimeError("fsdp2's memory planner: a group chose its transport again during the step")
        experts = moe.moe_layers(model.layers[0])
        return Simulation(**result, n_blocks=n_blocks, param_dtype=pdtype, model_dim=_model_dim(model),
                          root=_bytes_of(model, layout.dp_shard), block=_bytes_of(model.layers[0], layout.dp_shard),
                          experts=_bytes_of(experts[0].experts, layout.dp_shard // layout.ep) if experts else None,
                          top_k=experts[0].top_k if experts else 0)


def _meshes(layout: Layout) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """(the world mesh, the data-parallel mesh, the experts' mesh) as the recipe builds them: with
    expert parallelism the shard axis is efsdp x ep, flattened back into dp_shard for the dense parts."""
    if layout.ep > 1:
        meshes = moe.expert_parallel_meshes("cpu", dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard,
                                            ep=layout.ep, tp=layout.tp)
        return meshes.world, meshes.dp, meshes.experts
    dims = {"dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard, "tp": layout.tp}
    mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    dp_mesh = mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
    return mesh, dp_mesh, dp_mesh


class GroupSizes(NamedTuple):
    """One group's sizes over the shard axis, for the bytes a step moves (``_quantized.wire_bytes``)."""

    layouts: list[Chunking]
    gather_dtypes: list[torch.dtype]
    unsharded: int  # the unsharded buffer's bytes (every entry padded and aligned)
    reduce: int  # the full gradients' bytes in the reduce dtype


def _bytes_of(module: nn.Module, world: int) -> GroupSizes:
    group = get_state(module).group
    params = group.params if group is not None else []
    sizes = group_bytes(params, world)
    layouts = [p.layout.with_world(world) if p.layout.world != world else p.layout for p in params]
    return GroupSizes(layouts, [p.param_dtype for p in params], sizes.unsharded, sizes.reduce)


def _build(builder: ModelBuilder, layout: Layout, tp_mesh: DeviceMesh | None, attention: CpuAttention) -> nn.Module:
    """The model on the meta device, tensor-parallelised, each block checkpointed if asked."""
    with _META, _Born() as born:  # its tensors made without a device: on meta, no data
        model = builder.build()
    if not isinstance(model, nn.Module):
        raise TypeError(f"ModelBuilder.build() must return an nn.Module, got {type(model).__name__}")
    tensors = [*model.parameters(), *model.buffers()]
    if not all(storage_key(t) in born.keys for t in tensors):
        raise TypeError("ModelBuilder.build() returned a model made before the call (fully_shard would change it "
                        "in place); make a new one inside the function, e.g. build=lambda: Model(args)")
    off = sorted({str(t.device) for t in tensors if not t.is_meta})
    if off:  # memory the planner was not to allocate
        raise TypeError(f"ModelBuilder.build() made tensors on {', '.join(off)}: make them on the default device "
                        "(the planner builds under torch.device('meta'), so nothing is allocated)")
    if not isinstance(getattr(model, "layers", None), nn.ModuleList) or len(model.layers) == 0:
        raise ValueError("estimate_memory needs a model whose blocks are in a non-empty nn.ModuleList `.layers`")
    if tp_mesh is not None:
        _apply_tp(model, tp_mesh, builder.tp_plan)
    if layout.activation_checkpointing:
        from torch.utils.checkpoint import checkpoint

        # Backward recomputes with the step's modes set aside: attention as the CPU picks it again.
        def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
            return contextlib.nullcontext(), attention

        for b in model.layers:
            b.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, context_fn=contexts,
                                                              **k))(b.forward)
    elif layout.selective_checkpointing == "op":
        from torch.utils.checkpoint import checkpoint

        from ._selective import op_level_contexts

        for b in model.layers:  # each call gets fresh contexts (the policy counts one block's matmuls)
            b.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False,
                                                              context_fn=op_level_contexts(attention), **k))(b.forward)
    return model


_META = torch.device("meta")


def _inputs(builder: ModelBuilder, layout: Layout) -> torch.Tensor:
    with _META:
        return builder.make_inputs(layout.batch, layout.seq)


def _loss(builder: ModelBuilder, output: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    with _META:  # (its constants too)
        return builder.loss_fn(output, tokens)


class _Born(TorchDispatchMode):
    """The storages made inside the block (``keys``)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: set[int | None] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.keys.update(storage_key(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


def _apply_tp(model: nn.Module, tp_mesh: DeviceMesh, tp_plan: Callable[[nn.Module, DeviceMesh], None] | None) -> None:
    """Tensor parallelism on the meta model: ``tp_plan``, or the Llama's own (``fsdp2.models.llama.tp_plan``)."""
    tp = tp_mesh.size()
    args = getattr(model, "args", None)
    if args is not None:
        heads, kv = args.n_heads, getattr(args, "kv_heads", args.n_heads)
        if heads % tp or kv % tp:
            raise ValueError(f"tp ({tp}) must divide the attention heads ({heads}) and kv heads ({kv})")
    if tp_plan is None and not isinstance(model, llama.Transformer):
        raise ValueError(
            f"estimate_memory(tp > 1) needs the tensor-parallel plan of {type(model).__name__}: pass "
            "ModelBuilder(build=..., tp_plan=fn) with fn(model, tp_mesh) applying its parallelize_module plan "
            "(only fsdp2.models.llama.Transformer has a default, its tp_plan)"
        )
    (tp_plan or llama.tp_plan)(model, tp_mesh)


def _shard(model: nn.Module, layout: Layout, dp_mesh: DeviceMesh, experts_mesh: DeviceMesh) -> None:
    """As the recipe: each MoE layer's experts one group (on their own mesh), each block one, then the root."""
    mp = MixedPrecisionPolicy(param_dtype=layout.param_dtype, reduce_dtype=layout.reduce_dtype)
    comm = layout.comm_policy
    moe.shard_experts(model, experts_mesh, ep=layout.ep, dp_size=layout.dp_replicate * layout.dp_shard,
                      mp_policy=mp, reshard_after_forward=layout.reshard_after_forward, comm_policy=comm)
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=layout.reshard_after_forward,
                    comm_policy=comm)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=layout.root_reshard_after_forward,
                comm_policy=comm)
    model.set_early_release(layout.root_early_release)


def _keeps_residuals(layout: Layout) -> bool:
    """Quantized gradients with error feedback: each parameter's residual, made at its first
    reduction, is kept from step to step (``runtime/_reduction.py``)."""
    comm = layout.comm_policy
    return comm is not None and comm.gradients is not None and comm.error_feedback


def _residuals(module: nn.Module) -> list[torch.Tensor]:
    group = get_state(module).group
    return [p.grad_residual for p in group.params if p.grad_residual is not None] if group is not None else []


def _groups(model: nn.Module) -> list[ParamGroup]:
    out = []
    for module in model.modules():
        state = get_state(module)
        for group in state.groups if state is not None else ():
            if group not in out:
                out.append(group)
    return out


def _step(model: nn.Module, builder: ModelBuilder, layout: Layout, opt: torch.optim.Optimizer) -> None:
    """The step before the one measured: the runtime learns the forward order (it prefetches by
    it) in a forward without autograd. A whole step where the next needs more: with
    ``grad_accum > 1`` its sharded gradients stay, as the earlier micro-batches' do; the root's
    early release learns in a backward which of its gradients are final when; quantized
    gradients with error feedback keep the residuals their first reduction made. The optimizer's
    state is then made as its first step makes it (``_first_state``), without the step's
    arithmetic (on DTensors, a large share of a plan's time)."""
    tokens = _inputs(builder, layout)
    if layout.grad_accum > 1 or layout.root_early_release or _keeps_residuals(layout):
        _loss(builder, model(tokens), tokens).backward()
    else:
        with torch.no_grad():
            model(tokens)
    _first_state(opt, layout.optimizer)
    if layout.grad_accum == 1:
        opt.zero_grad(set_to_none=True)


def _first_state(opt: torch.optim.Optimizer, name: str) -> None:
    """The state ``opt`` makes at its first step, as torch's optimizers make it (``_init_group``):
    Adam(W) a scalar step and two zeros the shape of each parameter (its shard), SGD with momentum
    one buffer the shape of its gradient (its shard), plain SGD none."""
    with torch.no_grad():
        for group in opt.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if name in ("adam", "adamw"):
                    opt.state[p].update(step=torch.zeros((), dtype=torch.float32),
                                        exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                                        exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
                elif name == "sgd_momentum":
                    opt.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        for plain in plain_tensors(t):
            key = storage_key(plain)
            if key is not None:
                seen[key] = plain.untyped_storage().nbytes()
    return sum(seen.values())


def _tracked_step(model: nn.Module, builder: ModelBuilder, layout: Layout, opt: torch.optim.Optimizer,
                  extra_blocks: int) -> dict:
    """The second step's forward, loss and backward under a ``_PlanTracker``."""
    block0 = model.layers[0]
    groups0 = _groups(block0)  # the block's group, and its experts' (MoE)
    shard_bytes = sum(p.layout.local_numel * p.orig_dtype.itemsize for g in groups0 for p in g.params)
    kept0 = _kept_after_forward(groups0)  # what each block not built holds from its forward to its backward
    tracker = _PlanTracker(model, opt)
    hooks = _PointHooks(model, tracker)
    saved = _SavedInBlock(block0, groups0)
    per_block = [0]
    residuals = _residuals(block0)  # quantized gradients' error feedback (kept from step to step)

    def block0_pre(_m: nn.Module, _a: object) -> None:
        if not _compat.in_backward():
            per_block[0] = -tracker.by_category()["activations"]

    def block0_post(_m: nn.Module, _a: object, _o: object) -> None:
        if _compat.in_backward():
            return
        per_block[0] += tracker.by_category()["activations"]
        if extra_blocks:  # the blocks not built run here, after block 0, as copies of it
            tracker.add_bytes("activations", extra_blocks * per_block[0])
            for category, nbytes in kept0.items():
                tracker.add_bytes(category, extra_blocks * nbytes)

    def block0_backward() -> None:  # their backward ran: sharded gradients left, the rest freed
        if extra_blocks:
            tracker.add_bytes("activations", -extra_blocks * per_block[0])
            for category, nbytes in kept0.items():
                tracker.add_bytes(category, -extra_blocks * nbytes)
            if layout.grad_accum == 1:  # (accumulating, they were there from the start)
                tracker.add_bytes("gradients", extra_blocks * shard_bytes)
            if residuals and held is None:  # the tracker sees a residual once its reduction reads it
                seen = [r for r in _residuals(model.layers[-1]) if storage_key(r) in tracker._live.labels]
                category = tracker._live.labels[storage_key(seen[0])] if seen else "communication"
                tracker.add_bytes(category, extra_blocks * _storage_bytes(residuals))

    handles = [block0.register_forward_pre_hook(block0_pre, prepend=True),
               block0.register_forward_hook(block0_post, prepend=True)]
    hooks.on_backward["layers.0"] = block0_backward
    if extra_blocks:
        states = [t for p in block0.parameters() for t in opt.state.get(p, {}).values() if isinstance(t, torch.Tensor)]
        tracker.extra["sharded_params"] += extra_blocks * _storage_bytes(
            [t for g in groups0 for t in g.held_tensors()["sharded_params"]])
        tracker.extra["optimizer_state"] += extra_blocks * _storage_bytes(states)
        if layout.grad_accum > 1:
            tracker.extra["gradients"] += extra_blocks * shard_bytes
        held = tracker._roles().get(storage_key(residuals[0])) if residuals else None
        if held is not None:  # kept all step long where the tracker counts them from the start
            tracker.extra[held] += extra_blocks * _storage_bytes(residuals)
        tracker._live.offset = sum(tracker.extra.values())
    try:
        with tracker, torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            tokens = _inputs(builder, layout)
            loss = _loss(builder, model(tokens), tokens)
            tracker.at = "loss"
            loss.backward()
            del loss, tokens
    finally:
        for handle in [*handles, *hooks.handles]:
            handle.remove()
    report = tracker.report
    shard_values = sum(p.layout.local_numel * p.orig_dtype.itemsize for g in _groups(model) for p in g.params)
    return dict(peak=report.peak_bytes, peak_by_category=report.peak_by_category, peak_point=report.peak_phase,
                points=dict(tracker._live.points), at_end=report.current_by_category,
                shard_values=shard_values + extra_blocks * shard_bytes,
                buffers=_storage_bytes(list(model.buffers())), saved_per_block=saved.total)


def _kept_after_forward(groups: list[ParamGroup]) -> dict[str, int]:
    """Bytes by category the groups keep from their forward to their backward: a group that does
    not reshard its whole unsharded buffer; one resharding to a smaller group (an int
    ``reshard_after_forward``) its rank's 1/n of the parameters, a communication buffer
    (``ParamGroup.reshard_to_subgroup``); one that reshards, nothing."""
    out = {"unsharded_params": 0, "communication": 0}
    for g in groups:
        policy = g.policy.reshard_after_forward
        if policy is False:
            out["unsharded_params"] += g._unsharded_bytes()
        elif g.subgroup is not None and policy is not True:
            out["communication"] += g._gather_format(g.subgroup.size).slice_bytes
    return out


class _PointHooks:
    """Name the point of the step: each module's forward, the loss, each module's backward, and
    the end of backward (fsdp2's end-of-backward work)."""

    def __init__(self, model: nn.Module, tracker: _PlanTracker) -> None:
        self.tracker = tracker
        self.on_backward: dict[str, Callable[[], None]] = {}
        self.names = {model: "root", **{b: f"layers.{i}" for i, b in enumerate(model.layers)}}
        self.root = model
        self.handles = []
        for module in self.names:  # prepended: before fsdp2's own hooks (its gathers belong to this point)
            self.handles.append(module.register_forward_pre_hook(self.pre_forward, prepend=True))
            self.handles.append(module.register_forward_hook(self.post_forward, prepend=True))

    def pre_forward(self, module: nn.Module, _args: object) -> None:
        if not _compat.in_backward():
            self.tracker.at = f"forward, {self.names[module]}"

    def post_forward(self, module: nn.Module, _args: object, output: object) -> None:
        if _compat.in_backward():
            return
        name = self.names[module]
        outputs = [t for t in (output if isinstance(output, tuple) else (output,))
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs:  # registered before fsdp2's pre-backward hook on the same outputs: runs first
            torch.autograd.graph.register_multi_grad_hook(outputs, lambda _g: self.pre_backward(name), mode="any")

    def pre_backward(self, name: str) -> None:
        if name == "root":  # queued before fsdp2's own end-of-backward callback, so it runs first
            _compat.queue_end_of_backward_callback(self.end_of_backward)
        self.tracker.at = f"backward, {name}"
        if name in self.on_backward:
            self.on_backward[name]()

    def end_of_backward(self) -> None:
        self.tracker.at = "end of backward"


class _SavedInBlock:
    """Bytes autograd saves inside block 0's forward, its parameters excepted."""

    def __init__(self, block: nn.Module, groups: list[ParamGroup]) -> None:
        self.groups = groups
        self.inside = False
        self.params: set[int] | None = None
        self.sizes: dict[int, int] = {}
        block.register_forward_pre_hook(lambda *_: self._enter(), prepend=True)
        block.register_forward_hook(lambda *_: setattr(self, "inside", False))

    def _enter(self) -> None:
        if not _compat.in_backward():
            self.inside, self.params = True, None

    @property
    def total(self) -> int:
        return sum(self.sizes.values())

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not self.inside:
            return t
        if self.params is None:  # the block's group is gathered by now
            self.params = self._param_keys()
        for plain in plain_tensors(t):
            key = storage_key(plain)
            if key is not None and key not in self.params:
                if len(self.groups) > 1:  # a group inside the block (MoE experts) may have been gathered since
                    self.params = self._param_keys()
                if key not in self.params:
                    self.sizes[key] = plain.untyped_storage().nbytes()
        return t

    def _param_keys(self) -> set[int | None]:
        return {storage_key(plain) for g in self.groups for ts in g.held_tensors().values() for x in ts
                for plain in plain_tensors(x)}


def _model_dim(model: nn.Module) -> int:
    norm = getattr(model, "norm", None)
    weight = getattr(norm, "weight", None)
    return weight.shape[0] if weight is not None else 0
