"""The few private PyTorch entry points fsdp2 needs, in one place.

Checked against torch 2.11 to 2.14, the range pyproject.toml allows (CI runs the whole suite
on 2.13 and the version-sensitive quick tests, marked ``compat``, on 2.11 and 2.14). Each has
no public equivalent; where releases differ, the difference is handled here.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor
from torch.overrides import has_torch_function


def queue_end_of_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the current autograd backward pass has finished.

    The engine's callback queue is the only hook that fires after *every*
    gradient of a backward is computed, including those of parameters whose
    per-tensor hooks never fire (unused parameters).
    """
    Variable._execution_engine.queue_callback(fn)


def run_eagerly(fn: Callable) -> Callable:
    """``fn``, hidden from ``torch.compile``: Dynamo graph-breaks at the call and runs it eagerly.

    fsdp2's hooks issue collectives, swap parameters and keep Python state between calls:
    none of that can be captured in a graph, and Dynamo tracing into them fails (it meets
    ``data_ptr()`` and the autograd engine's private queries). ``recursive=True`` also keeps
    Dynamo out of every frame the hook calls. A module compiled in place
    (``block.compile()``) does not trace ``nn.Module._call_impl`` itself, so its hooks then
    run before and after the compiled ``forward`` with no graph break at all.

    ``torch._dynamo.config.skip_fsdp_hooks`` (torch before 2.13; False asked to trace
    torch's FSDP2 hooks into the graph) is not consulted: fsdp2's hooks always run eagerly.
    ``torch.compiler.disable`` is public. It imports Dynamo, so fsdp2 wraps its hooks in
    ``fully_shard`` (where making the DTensor parameters has imported Dynamo already), never
    at import. Eagerly, the wrapper costs under a microsecond a call.
    """
    return torch.compiler.disable(fn, recursive=True, reason="fsdp2 hook: runs eagerly, outside the graph")


def refuse_compiled_autograd() -> None:
    """Raise if this backward runs under compiled autograd (``torch._dynamo.compiled_autograd``).

    Compiled autograd traces the backward's hooks into a graph, fsdp2's gradient hooks
    included, and those cannot be traced (see ``run_eagerly``); refusing here gives a clear
    error instead of one from deep inside Dynamo. The flag is private (torch 2.13).
    """
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    if module is not None and (getattr(module, "compiled_autograd_enabled", False)
                               or getattr(module, "in_compiled_autograd_region", False)):
        raise RuntimeError(
            "fsdp2 does not support compiled autograd (torch._dynamo.compiled_autograd / "
            "torch._dynamo.config.compiled_autograd=True): its gradient hooks run eagerly and cannot be "
            "traced. Run backward without it; torch.compile of the forward works"
        )


def chunk_cat(tensors: list[torch.Tensor], world: int, out: torch.Tensor) -> None:
    """Row ``r`` of ``out`` (``world`` x total) := chunk ``r`` of each tensor, concatenated.

    Chunk ``r`` is rows ``r * c`` to ``(r + 1) * c`` of dim 0, ``c = ceil(n / world)``, zero
    past the end, cast to ``out``'s dtype: the rank-major reduce-scatter input in one op
    instead of a view and a copy per gradient. ``torch._chunk_cat`` is private (torch 2.13;
    torch's FSDP2 builds its reduce-scatter input with it).
    """
    torch._chunk_cat(tensors, dim=0, num_chunks=world, out=out)


def in_backward() -> bool:
    """True while the autograd engine is running a backward on this thread.

    Used to recognise forwards re-run inside backward (activation
    checkpointing), which must not reshard the parameters backward needs.
    """
    return torch._C._current_graph_task_id() != -1


def references(t: torch.Tensor) -> tuple[int, int, int]:
    """What holds ``t`` now: tensors on its storage (``torch._C._storage_Use_Count``), C++ handles
    to it (``Tensor._use_count``: autograd's saved tensors and accumulators, views' bases) and
    Python references (``sys.getrefcount``, this call's own included)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata), t._use_count(), sys.getrefcount(t) - 1


def dtensor_local(dtensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local data itself: no autograd node, no copy (``to_local()`` records a
    differentiable view, which a per-step pointer check or an in-place ``.grad`` add must not)."""
    return dtensor._local_tensor


def set_dtensor_local(dtensor: torch.Tensor, local: torch.Tensor) -> None:
    """Point an existing DTensor (e.g. a registered parameter) at new local data.

    Keeps the Python object, so optimizers and user references to the
    parameter stay valid across ``module.to_empty()`` / ``.to()``. DTensor
    exposes no public setter for its local tensor.
    """
    dtensor._local_tensor = local


def dtensor_like(dtensor: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A new DTensor with ``dtensor``'s mesh, placements and global shape around ``local``.

    ``local`` must have the local shape and dtype of ``dtensor``. Reuses the
    existing sharding spec, which skips ``DTensor.from_local``'s autograd
    function and spec construction: gradients of every parameter are wrapped
    this way every step (costs: docs/performance.md, "Small costs behind the code").

    Calls ``DTensor.__new__`` alone (torch 2.13: the C constructor
    ``Tensor._dtensor__new__``, which sets ``_spec`` and ``_local_tensor``):
    ``DTensor.__init__`` does nothing but pass through a Dynamo-disable and an
    export-tracing wrapper, and this runs eagerly in fsdp2's hooks.
    """
    return DTensor.__new__(DTensor, local, dtensor._spec, requires_grad=False)


def dtensor_on(local: torch.Tensor, mesh, placements: tuple, shape: torch.Size,
               stride: tuple[int, ...]) -> torch.Tensor:
    """A DTensor of global ``shape``/``stride`` on ``mesh`` around ``local``, where ``local`` is.

    ``DTensor.from_local`` moves a local tensor to the mesh's device type: with CPU offload
    under a CUDA mesh, the sharded parameter would then be a CUDA copy of the host shard
    (the optimizer stepping on the copy, ``.grad`` refused on the host). Built from a
    ``DTensorSpec`` (private, torch 2.11 to 2.14) and the same constructor as
    :func:`dtensor_like` instead, the local tensor stays the host shard itself.
    """
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor.__new__(DTensor, local, spec, requires_grad=False)


def _contract():
    """The module ``torch.distributed._composable.contract`` (its package exports a function of that name)."""
    import importlib
    return importlib.import_module("torch.distributed._composable.contract")


def composable_apis(module: nn.Module) -> dict:
    """The names of torch's composable distributed APIs applied to ``module`` (``replicate``,
    ``fully_shard``...): the registry their ``contract`` keeps on each module, under an attribute
    named by ``torch.distributed._composable.contract.REGISTRY_KEY`` (private, torch 2.11 to 2.14).
    Empty where none was applied."""
    return module.__dict__.get(_contract().REGISTRY_KEY) or {}


def register_composable(module: nn.Module, name: str) -> Callable[[], None]:
    """Enter ``name`` in ``module``'s registry of composable APIs (see :func:`composable_apis`), as
    torch's APIs do for themselves, so that they see it: torch's ``replicate`` leaves the
    parameters of a module registered as ``"fully_shard"`` to it, and refuses to wrap such a
    module. Returns what undoes it (nothing when ``name`` was there already)."""
    contract = _contract()
    registry = module.__dict__.setdefault(contract.REGISTRY_KEY, collections.OrderedDict())
    if name in registry:
        return lambda: None
    registry[name] = contract.RegistryItem()
    return lambda: registry.pop(name, None)


def keep_spec(made: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Give ``made`` (an alias of the DTensor ``source``) ``source``'s sharding spec back.

    DTensor ops take their output spec from a cache that compares meshes by value: after
    an equal mesh was built earlier in the process (same shape, names and ranks, other
    process groups), ``nn.Parameter(dtensor)`` or ``dtensor.detach()`` can come back on
    that older mesh, and collectives then run on its groups (hangs when it differs between
    ranks, errors when it was destroyed). A no-op for plain tensors.
    """
    if isinstance(source, DTensor) and made._spec is not source._spec:
        made._spec = source._spec
    return made


def parameter(data: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """``nn.Parameter(data, requires_grad)`` that keeps a DTensor on its own mesh (``keep_spec``)."""
    return keep_spec(nn.Parameter(data, requires_grad=requires_grad), data)


def detach(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()`` that keeps a DTensor on its own mesh (``keep_spec``)."""
    return keep_spec(t.detach(), t)


# ---- the flat collectives --------------------------------------------------------------
# torch 2.13 renamed them (the old names warn); older releases only have the old ones. The
# process group's own methods run them: ``all_gather_single`` / ``reduce_scatter_single``
# from 2.13, ``_allgather_base`` / ``_reduce_scatter_base`` (private) before.
_C10D = torch.distributed.distributed_c10d
_RENAMED = hasattr(torch.distributed, "all_gather_single")
_ALL_GATHER = torch.distributed.all_gather_single if _RENAMED else torch.distributed.all_gather_into_tensor
_REDUCE_SCATTER = torch.distributed.reduce_scatter_single if _RENAMED else torch.distributed.reduce_scatter_tensor
_ALL_GATHER_METHOD = "all_gather_single" if _RENAMED else "_allgather_base"
_REDUCE_SCATTER_METHOD = "reduce_scatter_single" if _RENAMED else "_reduce_scatter_base"


def _plain_call(group, tensor: torch.Tensor) -> bool:
    """Whether torch's public collective would do nothing but call ``group``'s own method: a
    process group this rank is in, a plain real tensor (no ``__torch_function__`` subclass or
    mode to hand the call to, nothing to view as real), no ``_coalescing_manager`` open
    (``_world.pg_coalesce_state``, private: there the call is recorded, not issued)."""
    return (isinstance(group, torch.distributed.ProcessGroup) and not has_torch_function((tensor,))
            and not tensor.is_complex() and not _C10D._world.pg_coalesce_state)


def all_gather_flat(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                    async_op: bool = False):
    """``dist.all_gather_single`` (``all_gather_into_tensor`` before torch 2.13), as fsdp2 calls it
    at every all-gather: ``group``'s own method directly where torch's function would do
    nothing else (``_plain_call``), which skips its argument checks and its logging wrapper,
    paid at every collective on every backend; else torch's function itself."""
    if not _plain_call(group, input_tensor):
        return _ALL_GATHER(output_tensor, input_tensor, group=group, async_op=async_op)
    opts = _C10D.AllgatherOptions()
    opts.asyncOp = async_op
    return _handed_back(getattr(group, _ALL_GATHER_METHOD)(output_tensor, input_tensor, opts), async_op)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, op=torch.distributed.ReduceOp.SUM, group=None,
                        async_op: bool = False):
    """``dist.reduce_scatter_single`` (``reduce_scatter_tensor`` before torch 2.13), called as
    :func:`all_gather_flat` calls its all-gather."""
    if not _plain_call(group, input):
        return _REDUCE_SCATTER(output, input, op=op, group=group, async_op=async_op)
    opts = _C10D.ReduceScatterOptions()
    opts.reduceOp = op
    opts.asyncOp = async_op
    return _handed_back(getattr(group, _REDUCE_SCATTER_METHOD)(output, input, opts), async_op)


def _handed_back(work, async_op: bool):
    """What torch's collective functions return for ``work``: it, with ``async_op``; else None,
    once it finished."""
    if async_op:
        return work
    if work is not None:
        work.wait()
    return None


def root_mesh(mesh):
    """The mesh ``mesh`` was sliced from (itself if it is a root).

    DeviceMesh exposes slicing but not the way back; the method moved from
    ``_mesh_resources.get_root_mesh`` (torch 2.6) to ``DeviceMesh._get_root_mesh``.
    """
    if hasattr(mesh, "_get_root_mesh"):
        return mesh._get_root_mesh()
    from torch.distributed.device_mesh import _mesh_resources
    return _mesh_resources.get_root_mesh(mesh)


def flatten_axes(mesh, axes) -> None:
    """Give ``mesh``'s ``axes`` (two or more, by index) one process group, so DTensor reduces over them at once.

    DTensor then reduces a value partial on those axes (a gradient norm under FSDP x TP) with
    one all-reduce instead of one per axis, and does not warn about the sequential ones; it finds
    the flattened mesh by layout in the root mesh, where ``DeviceMesh._flatten`` (private, no
    public name in torch 2.11-2.14; torchtitan flattens its meshes the same way) registers it.
    Collective on first use (a new process group); later calls find it. Meshes without axis
    names are left alone (``_flatten`` slices by name).
    """
    names = mesh.mesh_dim_names
    if names is None or len(axes) < 2 or not hasattr(mesh, "_flatten"):
        return
    picked = tuple(names[i] for i in axes)
    flat_name = "_".join(picked)
    root = root_mesh(mesh)
    if flat_name in getattr(root, "_flatten_mapping", {}):
        return
    mesh[picked]._flatten(flat_name)


def flattened(mesh, names):
    """``mesh``'s axes ``names`` as one axis: ``mesh[name]`` for one, else ``DeviceMesh._flatten``
    (private, torch 2.11-2.14; what torch's FSDP2 does with several ``dp_mesh_dims`` axes, under
    the same name, so both find the same flattened mesh and process group). Collective on first
    use (a new process group); later calls find it."""
    names = tuple(names)
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


def concat_meshes(meshes):
    """One mesh whose axes are those of ``meshes`` in order (all sliced from one root)."""
    from torch.distributed.device_mesh import DeviceMesh
    if hasattr(DeviceMesh, "_concatenate"):
        return DeviceMesh._concatenate(list(meshes))
    names = tuple(name for mesh in meshes for name in mesh.mesh_dim_names)
    return root_mesh(meshes[0])[names]


def joinable_meshes(first, second) -> bool:
    """Whether ``concat_meshes([first, second])`` makes a mesh: both derived from one world mesh
    (by slicing, ``_unflatten`` or ``_flatten``) and on disjoint ranks' axes (orthogonal).

    ``DeviceMesh._concatenate`` (private, no public equivalent; read in torch 2.13, where torch's
    FSDP2 joins its data-parallel and TP/EP meshes with it) checks both and raises otherwise; a
    torch without it joins axes of one root mesh only, by name (``concat_meshes``).
    """
    from torch.distributed.device_mesh import DeviceMesh
    if not hasattr(DeviceMesh, "_concatenate"):
        names = tuple((first.mesh_dim_names or ()) + (second.mesh_dim_names or ()))
        root = root_mesh(first)
        return root_mesh(second) is root and set(names) <= set(root.mesh_dim_names or ())
    try:
        DeviceMesh._concatenate([first, second])
    except (RuntimeError, ValueError, AssertionError):
        return False
    return True


def strided_shard(dim: int, split_factor: int):
    """DTensor's placement for "shard dim ``dim`` of each of ``split_factor`` pieces".

    Needed when FSDP shards a dimension tensor parallelism already split:
    the data-parallel chunks interleave with the TP chunks. Private in torch.
    """
    from torch.distributed.tensor.placement_types import _StridedShard
    return _StridedShard(dim, split_factor=split_factor)


def prepend_post_accumulate_grad_hook(param, hook):
    """``param.register_post_accumulate_grad_hook(hook)``, but run before the hooks already there.

    The memory tracker must see a gradient before fsdp2's own hook hands the last gradient
    of a group to its reduce-scatter (which drops ``.grad``). Tensors keep these hooks in
    the private ordered dict ``_post_accumulate_grad_hooks`` (torch 2.6 to 2.13).
    """
    handle = param.register_post_accumulate_grad_hook(hook)
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    if hooks is not None and handle.id in hooks:
        # Re-insert, not move_to_end: the engine walks the underlying dict's own order.
        items = dict(hooks)
        hooks.clear()
        hooks[handle.id] = items.pop(handle.id)
        hooks.update(items)
    return handle


def run_post_accumulate_grad_hooks(param: torch.Tensor) -> None:
    """Run the hooks registered on ``param`` with ``register_post_accumulate_grad_hook``, in order.

    A sharded parameter never reaches autograd's gradient accumulation (its unsharded alias
    does), so fsdp2 runs its hooks once the gradient shard is final, as torch's FSDP2 does.
    The hooks live in the private ordered dict ``_post_accumulate_grad_hooks`` (torch 2.6 to
    2.13; absent or None when none was registered); there is no public way to run them.
    """
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    if hooks:
        for hook in list(hooks.values()):
            hook(param)


def has_post_accumulate_grad_hooks(param: torch.Tensor) -> bool:
    """Whether ``param`` has hooks for :func:`run_post_accumulate_grad_hooks` to run (same private dict)."""
    return bool(getattr(param, "_post_accumulate_grad_hooks", None))


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (``jvp``, ``vmap``, ``grad``...) is running (private, torch 2.0 to 2.13)."""
    return torch._C._are_functorch_transforms_active()


def outside_functorch() -> contextlib.AbstractContextManager:
    """Run fsdp2's own tensor work outside any ``torch.func`` transform (``jvp``, ``vmap``...).

    Under a transform, tensors created by factory functions come back wrapped for it: a
    gathered parameter buffer or a collective's output allocated inside ``torch.func.jvp``
    would be a wrapper that dies with the transform (and gloo cannot read it). The
    transform must see the gathered parameters as plain constants. ``_DisableFuncTorch``
    (private, torch 2.0 to 2.13) is the only way out of an active transform. Twice per group
    per forward: outside a transform, one shared no-op context (no generator made).
    """
    return torch._C._DisableFuncTorch() if functorch_active() else _NO_CONTEXT


_NO_CONTEXT = contextlib.nullcontext()


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A default process group of ``world_size`` ranks, as rank 0, whose collectives do nothing.

    The memory planner runs fsdp2 on the meta device in one process, as rank 0 of the planned
    world: DeviceMesh and DTensor need a process group, not data. torch's "fake" backend (registered by
    ``torch.testing._internal.distributed.fake_pg``, torch 2.6 to 2.13) is that; there is
    no public equivalent. Refused when this process already has a default process group.

    DTensor's sharding-propagation caches are emptied on entry and on exit: they compare meshes
    by value, so a simulated mesh kept there would be handed to the real run's mesh of the same
    shape afterwards, and DTensor's random initialisation would then take rank 0's coordinates on
    every rank (every rank got rank 0's initial weights; ``tests/tools/test_plan_then_train.py``).
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ValueError(
            "estimate_memory runs fsdp2 on a fake process group of the planned world size and "
            "needs a process without one: call it before init_process_group (or use python -m fsdp2.plan)"
        )
    clear_dtensor_caches()
    hook = sys.excepthook  # init_process_group wraps it (a "[rankN]" prefix) each time: put it back
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    sys.excepthook = hook
    try:
        yield
    finally:
        dist.destroy_process_group()
        clear_dtensor_caches()


def clear_dtensor_caches() -> None:
    """Empty DTensor's sharding-propagation caches (its Python one, for this thread, and its C++
    fast path's).

    With the calls ``torch.distributed.tensor.debug._clear_sharding_prop_cache`` makes (private;
    the same on torch 2.11, 2.13 and 2.14), not through that package, which imports numpy:
    without numpy the C++ cache kept the planner's simulated meshes (every rank then got rank
    0's initial weights). Where the C++ call is missing, only the Python cache is emptied.
    """
    propagator = DTensor._op_dispatcher.sharding_propagator
    getattr(propagator.propagate_op_sharding, "cache_clear", lambda: None)()
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_fast_path is not None:
        clear_fast_path()


def is_live_process_group(pg) -> bool:
    """Whether ``pg`` is still registered (not passed to ``destroy_process_group``).

    The registry is c10d's private ``_world.pg_map``; where it is missing, every group
    counts as live (resources kept per group are then never released early).
    """
    import torch.distributed.distributed_c10d as c10d
    world = getattr(c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None)
    return pg_map is None or pg in pg_map


def call_after_process_group_shutdown(listener: Callable[[object], None]) -> None:
    """Have every ``pg.shutdown()`` call ``listener(pg)`` once it has returned.

    ``destroy_process_group`` shuts down each group it destroys (the one given, or every
    group) before unregistering it, and c10d tells nobody else: ``ProcessGroup.shutdown``
    is the one method both of its paths call (torch 2.11 and 2.13 read). So that method is
    wrapped on the class, once per process: the wrapper calls torch's, then each listener
    (an exception of a listener is logged, never raised into ``destroy_process_group``).
    A listener is added once however often it is passed. The listeners live on the wrapper
    itself, not in a module global.
    """
    import torch.distributed as dist

    cls = dist.ProcessGroup
    listeners = getattr(cls.__dict__.get("shutdown"), "_fsdp2_listeners", None)
    if listeners is None:
        listeners = []
        cls.shutdown = _shutdown_then_tell(cls.shutdown, listeners)
    if listener not in listeners:
        listeners.append(listener)


def _shutdown_then_tell(shutdown: Callable, listeners: list[Callable[[object], None]]) -> Callable:
    def shutdown_then_tell(self, *args, **kwargs):
        result = shutdown(self, *args, **kwargs)
        for listener in tuple(listeners):
            try:
                listener(self)
            except Exception:  # noqa: BLE001 - the group is gone either way; say so and go on
                logging.getLogger(__name__).exception("fsdp2: a process group shutdown listener failed")
        return result

    shutdown_then_tell._fsdp2_listeners = listeners
    shutdown_then_tell.__doc__ = shutdown.__doc__
    return shutdown_then_tell


def process_group_timeout(pg) -> float:
    """``pg``'s timeout in seconds, as given to ``init_process_group``/``new_group``.

    Read from the CPU backend's private ``options._timeout``; torch's default (30 minutes)
    where that is missing.
    """
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        from torch.distributed.constants import default_pg_timeout
        return default_pg_timeout.total_seconds()


def profiler_enabled() -> bool:
    """Whether torch's profiler is recording on this thread (``torch.autograd._profiler_enabled``).

    fsdp2 names its collectives in the profile (``record_function``), which costs time for
    each range even when nothing records: a few hundred ranges a step for a 32-block model.
    """
    return torch.autograd._profiler_enabled()


def dispatch_modes_active() -> bool:
    """Whether a ``TorchDispatchMode`` (``CommDebugMode``, a memory tracker...) is active on this
    thread: the length of the mode stack, a private C query (torch 2.0 to 2.14), cheap enough
    for every collective."""
    return torch._C._len_torch_dispatch_stack() > 0


@contextlib.contextmanager
def outside_dispatch_modes() -> Iterator[None]:
    """Run fsdp2's own bookkeeping with this thread's dispatch modes set aside.

    Checks between ranks torch's FSDP2 does not do (the lazy-init agreement check, the
    transport's probe): a mode that counts collectives (``CommDebugMode``) must see FSDP's
    all-gathers and reduce-scatters, as with torch, not these. The packed shards' buffer
    (``runtime/_buffers.py``): a mode that counts storages must see each shard's own storage
    once, not the buffer under them as well. The modes are back on when
    the block exits. ``_disable_current_modes`` (private, torch 2.0 to 2.14) is the only way
    to step out of the mode stack.
    """
    if not dispatch_modes_active():
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def cpu_picks_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool,
                              scale: float | None, enable_gqa: bool) -> bool:
    """Whether ``F.scaled_dot_product_attention`` on these CPU tensors takes the flash kernel.

    The memory planner runs on the meta device, where the math kernel is always taken; it asks
    the CPU's choice (``aten._fused_sdp_choice``, which has no public equivalent) to allocate
    what a CPU run allocates (``plan/_meta_attention.py``).
    """
    from torch.nn.attention import SDPBackend

    choice = torch.ops.aten._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    return choice == SDPBackend.FLASH_ATTENTION.value


def cpu_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float,
                        is_causal: bool, attn_mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """The CPU's flash-attention kernel called directly (``aten._scaled_dot_product_flash_attention_for_cpu``:
    on meta tensors, its meta implementation and autograd formula), its output alone."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def wrap_dcp_writer_files(writer, wrap: Callable):
    """Route every file a ``torch.distributed.checkpoint.FileSystemWriter`` opens through ``wrap(backend)``.

    The writer keeps its file-system backend in the attribute ``fs`` and opens each file it
    writes (the data files, then ``.metadata.tmp``, which it renames by ``fs.rename``) through
    ``fs.create_stream(path, mode)``: the only place a writer's bytes can be seen on their way
    out, which ``fsdp2.checkpoint`` uses to checksum them without reading the files back. No
    public hook exists. Read on torch 2.13; earlier and later releases' ``filesystem.py`` open
    and rename through the same two methods. Returns the wrapped backend, or None where the writer has no such
    backend (the caller then sums the files by reading them).
    """
    fs = getattr(writer, "fs", None)
    if fs is None or not callable(getattr(fs, "create_stream", None)) or not callable(getattr(fs, "rename", None)):
        return None
    writer.fs = wrap(fs)
    return writer.fs


def pipeline_stage_and_schedule(module: object) -> tuple[object | None, object | None]:
    """The ``torch.distributed.pipelining`` stage whose module is ``module`` and its schedule, if
    the caller's frames hold them; (None, None) when pipelining is not imported.

    pipelining gives a stage's module no way to know it is one (``runtime/_pipeline.py`` needs to,
    for a module it does not drive). Its base classes ``_PipelineStageBase`` and
    ``_PipelineSchedule`` (private; the same names in torch 2.11 and 2.13) are what a frame's
    ``self`` is checked against; only frames of pipelining's own files are looked into.
    """
    stage_module = sys.modules.get("torch.distributed.pipelining.stage")
    schedules = sys.modules.get("torch.distributed.pipelining.schedules")
    stage_base = getattr(stage_module, "_PipelineStageBase", None)
    schedule_base = getattr(schedules, "_PipelineSchedule", None)
    if stage_base is None:
        return None, None
    folder = os.path.dirname(stage_module.__file__) + os.sep
    stage = schedule = None
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(folder) and "self" in code.co_varnames:
            owner = frame.f_locals.get("self")
            if stage is None and isinstance(owner, stage_base) and owner.submod is module:
                stage = owner
            elif schedule is None and schedule_base is not None and isinstance(owner, schedule_base):
                schedule = owner
        frame = frame.f_back
    return stage, schedule


def in_pipeline_shape_inference(module: object) -> bool:
    """Whether the caller runs under the shape inference of the pipelining stage whose module is
    ``module``: torch 2.11's ``_PipelineStageBase._shape_inference`` runs the stage's forward once
    under ``no_grad`` on zeros, before its first step (private; 2.13 and 2.14 infer the metadata
    with gradients on and have no such function). Only pipelining's own frames are looked into.
    """
    stage_module = sys.modules.get("torch.distributed.pipelining.stage")
    if stage_module is None:
        return False
    folder = os.path.dirname(stage_module.__file__) + os.sep
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_shape_inference" and code.co_filename.startswith(folder):
            return getattr(frame.f_locals.get("self"), "submod", None) is module
        frame = frame.f_back
    return False


def schedule_splits_backward(schedule: object) -> bool:
    """Whether a pipelining schedule runs separate input and weight passes (zero bubble, DualPipeV).

    Read from its action lists (``pipeline_order``, or ``pipeline_order_with_comms`` for a
    schedule loaded with communication actions; private, torch 2.11 and 2.13): an action whose
    ``computation_type`` is ``BACKWARD_INPUT`` or ``BACKWARD_WEIGHT``, on its own or within an
    overlapped pair (``sub_actions``).
    """
    def split(action: object) -> bool:
        if action is None:
            return False
        kind = getattr(getattr(action, "computation_type", None), "name", None)
        sub_actions = getattr(action, "sub_actions", None) or ()
        return kind in ("BACKWARD_INPUT", "BACKWARD_WEIGHT") or any(map(split, sub_actions))

    for attribute in ("pipeline_order", "pipeline_order_with_comms"):
        order = getattr(schedule, attribute, None)
        if isinstance(order, dict) and any(split(a) for actions in order.values() for a in actions or ()):
            return True
    return False


def pipeline_last_backward(schedule: object, stage: object) -> bool | None:
    """Whether the backward pass a pipelining schedule runs now for ``stage`` is the stage's
    last of the step that computes weight gradients; None where the schedule does not say.

    ``_PipelineScheduleRuntime`` (the zero-bubble schedules' and DualPipeV's base) counts each
    stage's full and weight-gradient passes in ``backward_counter`` (a ``Counter`` by stage
    index, cleared at each step, bumped before the pass runs) and compares it with
    ``_n_microbatches``, as it decides ``last_backward`` itself (private; the same in torch 2.11,
    2.13 and 2.14). Read from the schedule object, not from frames: on CUDA the autograd
    engine runs the hooks that ask on its own device threads.
    """
    counter = getattr(schedule, "backward_counter", None)
    n_microbatches = getattr(schedule, "_n_microbatches", None)
    index = getattr(stage, "stage_index", None)
    if not isinstance(counter, collections.Counter) or not isinstance(n_microbatches, int) or index is None:
        return None
    return counter[index] == n_microbatches


# torch 2.11's ``DefaultStager`` closes its inner stager at the end of every ``stage`` (which
# empties its copy table and its cache of host buffers), so a second save through it fails
# (``KeyError: <class 'type'>``) and nothing could be reused anyway; 2.13 closes it only in
# ``close()``. 2.12 was not checked: it is taken with 2.11. (Read on 2.11.0, 2.13.0 and 2.14.1.)
DCP_STAGER_REUSABLE = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def dcp_stager(*, pinned: bool):
    """A ``torch.distributed.checkpoint`` stager that copies a state dict into host buffers it keeps.

    ``DefaultStager`` (``torch.distributed.checkpoint.staging``, with ``StagingOptions``) caches
    one host copy per source storage and copies into it again on the next save, so repeated
    async saves reuse the same memory; ``async_save(..., async_stager=...)`` takes it. Both came
    with torch 2.9 (pytorch PR 156207); read on 2.13; CI's 2.11 and 2.14 runs reach them through
    tests/tools/test_checkpoint_async.py (a ``compat`` file).
    Staging is synchronous (the caller returns once the copy is done, so training may change
    the parameters right away); ``pinned`` pins the buffers and copies without blocking each
    tensor, which needs CUDA. Raises RuntimeError naming the torch release where they are missing.
    Before torch 2.13 a stager serves one save only (``DCP_STAGER_REUSABLE``): take a new one each time.
    """
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        raise RuntimeError(f"fsdp2.checkpoint.AsyncSaver needs torch.distributed.checkpoint.staging.DefaultStager "
                           f"(torch >= 2.9); this is torch {torch.__version__}: use async_mode='off'") from None
    return DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=pinned))
