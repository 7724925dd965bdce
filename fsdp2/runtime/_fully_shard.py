"""The ``fully_shard`` entry point: validate everything, then shard.

Every check runs before the first change, so a bad argument leaves the
user's module exactly as it was.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from .._api import (CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy, QuantizedComm,
                   as_comm_policy, as_mixed_precision_policy, as_offload_policy)
from .. import _compat
from . import _extension, _pipeline
from ._group import ParamGroup, SubGroup
from ._mesh import DataParallelMesh, SpmdAxes, resolve_mesh, resolve_spmd_mesh, tp_mesh_of
from ._module import FSDPModule
from ._param import ShardedParam
from ._placement import Placements, check_placement_fn, placement_dims
from .._errors import FSDPOrderError, FSDPTypeError, FSDPValueError
from ._state import get_state
from ._state import ModuleState

__all__ = ["fully_shard"]

ModuleOrModules = Union[nn.Module, "list[nn.Module]"]


def fully_shard(
    module: ModuleOrModules,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    comm_policy: QuantizedComm | None = None,
) -> ModuleOrModules:
    """Shard ``module``'s parameters across the data-parallel ranks of ``mesh``.

    Each parameter the module owns (not already claimed by a ``fully_shard``
    on a submodule: call it bottom-up, blocks first, root last) becomes a
    DTensor ``Shard(0)`` on ``mesh``. The parameters form one group: before
    forward they are all-gathered in one collective into one buffer and the
    module sees full tensors; after forward they are freed again (per
    ``reshard_after_forward``); backward gathers them again, and once their
    gradients are ready one reduce-scatter averages them, leaving each rank
    its gradient shard on the sharded parameter's ``.grad``. Optimizers step
    on the shards with no communication.

    Args:
        module: a module, or a list of modules that form one group.
        mesh: 1-D :class:`DeviceMesh` of the data-parallel ranks; ``None``
            means all ranks of the default process group on the default device.
        reshard_after_forward: ``True`` frees parameters after forward and
            gathers them again in backward; ``False`` keeps them; ``None``
            means ``False`` for the root and ``True`` otherwise; an ``int``
            ``k`` keeps 1/k of them after forward, so backward gathers over
            ``k`` ranks only (``k`` must divide the mesh size; with several meshes,
            each group's, where ``k`` equal to its shard axis means ``True``).
        shard_placement_fn: maps a parameter to ``Shard(dim)`` (or ``None``
            for ``Shard(0)``), or to torch's ``ShardPlacementResult`` (a placement and a
            ``mesh_info``): another mesh makes a parameter group of its own, an SPMD one where
            the ``mesh_info`` names ``dp_mesh_dims`` (see ``_placement.py``).
        mp_policy: see :class:`MixedPrecisionPolicy` (torch's is accepted too and converted).
        offload_policy: :class:`CPUOffloadPolicy` keeps shards and gradients on the CPU
            (torch's ``OffloadPolicy`` / ``CPUOffloadPolicy`` are accepted too).
        ignored_params: parameters left untouched (not sharded, not reduced).
        dp_mesh_dims: :class:`DataParallelMeshDims`: ``mesh`` is then the whole SPMD mesh
            (e.g. data-parallel x tensor-parallel), every parameter a DTensor on it with
            ``Replicate()`` on the data-parallel axes; fsdp2 shards over the ``shard`` axis
            (and replicates over ``replicate``) and keeps the other axes' placements.
        comm_policy: :class:`QuantizedComm` to send the weights quantized (fsdp2's own; torch
            has none); ``None`` (the default) sends them as they are.

    Returns:
        ``module``, whose class now also derives from :class:`FSDPModule`.

    Raises:
        TypeError / ValueError: for bad arguments, naming the fix; the module
        is left unchanged.
    """
    modules = check_modules(module)
    args = check_arguments(mesh=mesh, reshard_after_forward=reshard_after_forward,
                           shard_placement_fn=shard_placement_fn, mp_policy=mp_policy, offload_policy=offload_policy,
                           ignored_params=ignored_params, dp_mesh_dims=dp_mesh_dims, comm_policy=comm_policy)
    found = _collect_params(modules, args.ignored_params)
    _check_order(found)
    placed = check_group(found, args)

    device = _compute_device(args.mesh)
    state: ModuleState | None = None
    marked: list[nn.Module] = []
    registered: list[Callable[[], None]] = []
    taken: list[int] = []  # the parameters replaced so far (by index in ``found``), to restore
    try:
        groups = []
        for index, group_mesh in enumerate(placed.meshes):
            members = [i for i, g in enumerate(placed.groups) if g == index]
            taken += members
            groups.append(_make_group([found[i] for i in members], [placed.dims[i] for i in members], args,
                                      args.mesh if group_mesh is None else group_mesh, placed.spmds[index], device))
        if device.type != "cpu":
            _move_buffers(modules, device)
        state = ModuleState(tuple(modules), groups, args.mp_policy)
        state.shared_with_other_groups = shared_with_other_groups(found)
        marked = _mark_managed(_managed_modules(modules, ignored_params))
        # Seen by torch's composable APIs: replicate() then leaves these modules' parameters alone.
        registered = [_compat.register_composable(m, "fully_shard") for m in modules]
        for m in modules:
            _swap_class(m)
    except BaseException:
        # Restore the original parameters, hooks and markers; never leave a half-sharded module.
        _unmark_managed(marked)
        for undo in registered:
            undo()
        for i in taken:
            param, locations, _fqn = found[i]
            for owner, name in locations:
                owner._parameters[name] = param
        if state is not None:
            state.remove()
        for m in modules:
            if isinstance(m, FSDPModule):
                m.__class__ = m.__class__.__mro__[2]
        raise
    # Mark the replaced originals: a module outside this call that still holds one shares a
    # parameter with this group, and a later fully_shard on it must refuse (see _collect_params).
    owner = type(modules[0]).__mro__[2].__name__  # the class before the FSDP<Class> swap
    for param, _locations, fqn in found:
        param.__dict__[_SHARDED_BY_ATTR] = f"fully_shard({owner}) as {fqn!r}"
    return module


def _make_group(found: list[Found], dims: list[int], args: Arguments, mesh: DeviceMesh, spmd: SpmdAxes | None,
                device: torch.device) -> ParamGroup:
    """One parameter group: ``found``'s parameters sharded on ``dims`` over ``mesh`` (the
    data-parallel axes of ``spmd``'s mesh where the group is on an SPMD mesh)."""
    mp_policy, offload_policy = args.mp_policy, args.offload_policy
    reshard_after_forward = group_reshard_after_forward(args, mesh)
    dp = DataParallelMesh.of(mesh, spmd)
    subgroup = None
    if not isinstance(reshard_after_forward, bool) and reshard_after_forward is not None:
        subgroup = SubGroup(dp, reshard_after_forward)
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    params = [ShardedParam(param, locations, fqn, dp, dim, mp_policy.param_dtype, mp_policy.reduce_dtype,
                           offload_to_cpu=offload, pin_memory=offload and offload_policy.pin_memory, device=device)
              for (param, locations, fqn), dim in zip(found, dims)]
    group = ParamGroup(params, dp, device, subgroup)
    group.policy.reshard_after_forward = reshard_after_forward
    group.policy.mp_policy = mp_policy
    comm = args.comm_policy
    if comm is not None and (comm.weight_block or comm.grad_block or comm.replicate_grad_block):
        group.policy.weight_block = comm.weight_block
        group.policy.grad_block = comm.grad_block
        group.policy.replicate_grad_block = comm.replicate_grad_block
        group.policy.grad_bits = comm.grad_bits or 8
        group.policy.weight_bits = comm.weight_bits or 8
        group.policy.error_feedback = comm.error_feedback
        group.refresh_transports()  # the reduce transport quantizes the gradients
    return group


# ---- markers for Dynamo and the ecosystem -----------------------------------------------
# What torch's fully_shard sets on the modules it manages, under the same names: Dynamo
# compiles such a module without specialising on (or guarding) its parameters, which fsdp2
# swaps between sharded and unsharded every forward; transformers' generate() turns on
# synced_gpus for it; accelerate and others test them to recognise FSDP.
_MANAGED_MARKERS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def _managed_modules(modules: list[nn.Module], ignored: set[nn.Parameter] | None) -> list[nn.Module]:
    """``modules`` and their submodules, less the subtrees an earlier ``fully_shard`` manages.

    Like torch's: given ``ignored_params`` (even empty), a module is left out when it has no
    buffers and every parameter it and its submodules hold is ignored (so parameterless
    modules too).
    """
    tops = set(modules)
    found: dict[nn.Module, None] = {}  # insertion-ordered set

    def visit(module: nn.Module) -> None:
        if module in found or (module not in tops and get_state(module) is not None) or _replicated(module):
            return
        found[module] = None
        for child in module.children():
            visit(child)

    for m in modules:
        visit(m)
    if ignored is None:
        return list(found)
    return [m for m in found if not _all_ignored(m, ignored)]


def _all_ignored(module: nn.Module, ignored: set[nn.Parameter]) -> bool:
    if any(True for _ in module.buffers(recurse=False)):
        return False
    if any(p not in ignored for p in module.parameters(recurse=False)):
        return False
    return all(_all_ignored(child, ignored) for child in module.children())


def _mark_managed(modules: list[nn.Module]) -> list[nn.Module]:
    """Set the markers on ``modules``; return those that did not have them (to undo)."""
    marked = []
    for m in modules:
        if all(m.__dict__.get(name) is True for name in _MANAGED_MARKERS):
            continue
        marked.append(m)
        for name in _MANAGED_MARKERS:
            m.__dict__[name] = True  # not setattr: a module's own __setattr__ may intercept
    return marked


def _unmark_managed(modules: list[nn.Module]) -> None:
    for m in modules:
        for name in _MANAGED_MARKERS:
            m.__dict__.pop(name, None)


def _replicated(module: nn.Module) -> bool:
    """Whether torch's composable ``replicate()`` (DDP) was applied to ``module``."""
    return "replicate" in _compat.composable_apis(module)


# ---- validation -------------------------------------------------------------------------
# fully_shard checks its modules (check_modules), its arguments (check_arguments) and the
# parameters it takes (check_group), in that order, before changing anything;
# fully_shard_auto's dry run makes the same three checks on every group it plans.
class Arguments(NamedTuple):
    """``fully_shard``'s keyword arguments once checked: what each group of a call shares."""

    mesh: DeviceMesh
    spmd: SpmdAxes | None  # the axes of an SPMD mesh (dp_mesh_dims), None for a data-parallel mesh
    reshard_after_forward: bool | int | None
    shard_placement_fn: Callable[[nn.Parameter], Any] | None
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    ignored_params: set[nn.Parameter]
    comm_policy: QuantizedComm | None = None
    # The int as passed (not resolved against this call's mesh): each group of several meshes
    # resolves it against its own (``group_reshard_after_forward``), as torch's fully_shard does.
    reshard_request: bool | int | None = None


def check_arguments(*, mesh: Any, reshard_after_forward: Any, shard_placement_fn: Any, mp_policy: Any,
                    offload_policy: Any, ignored_params: Any, dp_mesh_dims: Any,
                    comm_policy: Any = None) -> Arguments:
    """``fully_shard``'s keyword arguments checked, and resolved (the default mesh, torch's
    policies as fsdp2's); TypeError / ValueError naming the fix otherwise."""
    spmd, request = None, reshard_after_forward
    if dp_mesh_dims is None:
        mesh = resolve_mesh(mesh)
    else:
        mesh, spmd = resolve_spmd_mesh(mesh, dp_mesh_dims)
    reshard_after_forward = _check_reshard_after_forward(reshard_after_forward, mesh)
    mp_policy, offload_policy = _check_policies(mp_policy, offload_policy, ignored_params, shard_placement_fn)
    comm_policy = _check_comm_policy(comm_policy, reshard_after_forward, mesh)
    return Arguments(mesh, spmd, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy,
                     ignored_params or set(), comm_policy, request)


def group_reshard_after_forward(args: Arguments, mesh: DeviceMesh) -> bool | int | None:
    """``reshard_after_forward`` for the group on ``mesh``: an int resolved against that mesh's
    shard axis (on a group of its size it means True; it must divide it)."""
    request = args.reshard_request
    if isinstance(request, int) and not isinstance(request, bool) and mesh is not args.mesh:
        return _check_reshard_after_forward(request, mesh)
    return args.reshard_after_forward


def check_group(found: list[Found], args: Arguments) -> Placements:
    """Every check on the parameters one ``fully_shard`` call would take; their shard dims and
    meshes (one parameter group per mesh, ``_placement.py``)."""
    placed = placement_dims(found, args.shard_placement_fn, args.mesh, args.spmd)
    _check_devices(found, args.mesh)
    if len(placed.meshes) > 1:
        _check_several_meshes(found, placed, args)
    if args.spmd is not None and found:  # torch refuses any int for the whole call, whatever mesh each group is on
        _check_spmd_reshard(args.reshard_request)
    for index, group_mesh in enumerate(placed.meshes):
        mesh = args.mesh if group_mesh is None else group_mesh
        members = [i for i, g in enumerate(placed.groups) if g == index]
        part, dims = [found[i] for i in members], [placed.dims[i] for i in members]
        reshard = group_reshard_after_forward(args, mesh)
        if placed.spmds[index] is None:  # a data-parallel mesh: plain or TP/EP parameters
            _check_tensor_parallel(part, mesh, reshard)
        else:  # an SPMD mesh (the call's dp_mesh_dims, or a ShardPlacementResult's)
            _check_spmd_params(part, placed.spmds[index], reshard)
        _extension.check_params(part, dims, mesh.size(mesh.ndim - 1), reshard)
    if args.comm_policy is not None and args.comm_policy.weight_block:
        _check_quantizable(found)
    return placed


def _check_several_meshes(found: list[Found], placed: Placements, args: Arguments) -> None:
    """Parameters on several meshes in one call (one group each): what fsdp2 does not combine yet."""
    other = next(m for m in placed.meshes if m is not None)
    fqn = found[placed.groups.index(placed.meshes.index(other))][2]
    for mesh, spmd in zip(placed.meshes, placed.spmds):
        if mesh is not None and spmd is None:  # (an SPMD one's axes were checked as dp_mesh_dims are)
            resolve_mesh(mesh)
    if args.comm_policy is not None:
        raise FSDPValueError(
            f"fully_shard: shard_placement_fn puts {fqn!r} on {other}, another mesh than this call's, and fsdp2 "
            "does not combine parameter groups on several meshes with comm_policy yet; shard the module that holds "
            "those parameters in a fully_shard call of its own first (e.g. fully_shard(block.moe.experts, "
            "mesh=edp_mesh, shard_placement_fn=lambda p: Shard(1)), then fully_shard(block, mesh=dp_mesh))"
        )


def check_modules(module: Any) -> list[nn.Module]:
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(
            f"fully_shard expects an nn.Module or a non-empty list of nn.Modules, got {type(module).__name__}"
        )
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(
                f"fully_shard: a {type(m).__name__} has no forward, so its hooks would never run; pass its "
                f"modules as a list to make one group of them (fully_shard(list(container), ...)), or "
                "shard each of them, or the module that calls them"
            )
        if get_state(m) is not None:
            raise FSDPValueError(
                f"fully_shard was already applied to this {type(m).__name__}; apply it once per module "
                "(bottom-up: blocks first, then the root)"
            )
    return modules


def _check_order(found: list[Found]) -> None:
    """Refuse a module inside one ``fully_shard`` already took: its parameters are that group's shards.

    ``_managed_modules`` marked every module of the earlier call's subtree; a marked module
    holding a DTensor parameter here (and no state of its own, else ``_collect_params`` would
    have skipped it) is a child sharded after its parent.
    """
    for param, locations, fqn in found:
        holder = next((m for m, _name in locations if m.__dict__.get(_MANAGED_MARKERS[0]) is True), None)
        if isinstance(param, DTensor) and holder is not None:
            raise FSDPOrderError(
                f"fully_shard: parameter {fqn!r} (of a {type(holder).__name__}) is already sharded by an earlier "
                "fully_shard on a module that contains it. fully_shard goes bottom-up: call fully_shard on the "
                "children (e.g. each block) first, then on the parent (the root last)"
            )


def _check_spmd_params(found: list[Found], spmd: SpmdAxes, reshard_after_forward: Any) -> None:
    """``dp_mesh_dims``: every parameter is a DTensor on the full mesh, replicated on the data-parallel
    axes (the call's mesh, or the one a ShardPlacementResult's mesh_info names)."""
    names = spmd.mesh.mesh_dim_names
    for param, _locations, fqn in found:
        if not isinstance(param, DTensor) or param.device_mesh != spmd.mesh:
            where = f"a DTensor on {param.device_mesh}" if isinstance(param, DTensor) else "a plain tensor"
            raise ValueError(
                f"fully_shard: with dp_mesh_dims every parameter must be a DTensor on the whole SPMD mesh it is "
                f"sharded over ({spmd.mesh}); {fqn!r} is {where}. Distribute it first, e.g. "
                "distribute_tensor / parallelize_module on that mesh with Replicate() on the data-parallel axes "
                "(or return a ShardPlacementResult whose mesh_info has no dp_mesh_dims for it)"
            )
        for axis in sorted(spmd.dp_axes):
            if not isinstance(param.placements[axis], Replicate):
                raise ValueError(
                    f"fully_shard: parameter {fqn!r} is {param.placements[axis]!r} on data-parallel axis "
                    f"{names[axis]!r}; with dp_mesh_dims it must be Replicate() there (fsdp2 shards it)"
                )
    if found:
        _check_spmd_reshard(reshard_after_forward)


def _check_spmd_reshard(reshard_after_forward: Any) -> None:
    if not isinstance(reshard_after_forward, (bool, type(None))):
        raise ValueError(f"fully_shard: reshard_after_forward={reshard_after_forward} (int) is not supported with "
                         "dp_mesh_dims; use True or False")


def _check_reshard_after_forward(value: Any, mesh: DeviceMesh) -> bool | int | None:
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise FSDPTypeError(
            f"fully_shard: reshard_after_forward must be None, a bool or an int, got {value!r}"
        )
    size = mesh.size(mesh.ndim - 1)  # the shard axis
    if value < 1 or size % value != 0:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(
            f"fully_shard: reshard_after_forward={value} must divide the mesh size {size}; "
            f"use one of {divisors} or a bool"
        )
    if value == 1:
        return False  # one rank holding everything is "keep the parameters"
    if value == size:
        return True
    return value


def _check_policies(mp_policy: Any, offload_policy: Any, ignored: Any,
                    placement_fn: Any) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    """The policies as fsdp2's own (torch's are converted, see ``as_mixed_precision_policy``)."""
    mp_policy = as_mixed_precision_policy(mp_policy)
    offload_policy = as_offload_policy(offload_policy)
    if ignored is not None and (not isinstance(ignored, (set, frozenset))
                                or not all(isinstance(p, nn.Parameter) for p in ignored)):
        raise TypeError("fully_shard: ignored_params must be a set of nn.Parameter")
    check_placement_fn(placement_fn)
    return mp_policy, offload_policy


def _check_comm_policy(policy: Any, reshard_after_forward: Any, mesh: DeviceMesh) -> QuantizedComm | None:
    """``comm_policy`` checked (None or a ``QuantizedComm``), and the combinations it does not support yet."""
    policy = as_comm_policy(policy)
    if policy is not None and policy.replicate_grad_block and mesh.ndim != 2:
        raise ValueError(
            f"fully_shard: comm_policy=QuantizedComm(gradient_axes={policy.gradient_axes!r}) quantizes HSDP's "
            f"all-reduce across replicas, and this {mesh.ndim}-D mesh has no replicate axis; pass a 2-D "
            "(replicate, shard) mesh or gradient_axes='shard'"
        )
    if policy is not None and policy.weight_block and not isinstance(reshard_after_forward, (bool, type(None))):
        raise ValueError(
            f"fully_shard: reshard_after_forward={reshard_after_forward} (int) is not supported with "
            f"comm_policy=QuantizedComm(weights={policy.weights!r}); use True or False, or weights=None"
        )
    return policy


def _check_quantizable(found: list[Found]) -> None:
    """Quantized weights: no parameter whose tensor subclass chooses what is gathered (its own format)."""
    for param, _locations, fqn in found:
        local = _compat.dtensor_local(param) if isinstance(param, DTensor) else param
        if _extension.has_extension(local, fqn):
            raise ValueError(
                f"fully_shard: parameter {fqn!r} ({type(local).__name__}) gathers its own data "
                "(fsdp_pre_all_gather), which comm_policy=QuantizedComm(weights=...) cannot quantize; "
                "shard it in a fully_shard call without comm_policy (or with weights=None)"
            )


Found = tuple[nn.Parameter, list[tuple[nn.Module, str]], str]

# Set on an original parameter once fully_shard has replaced it by its sharded DTensor.
_SHARDED_BY_ATTR = "_fsdp2_sharded_by"


def _collect_params(modules: list[nn.Module], ignored: set[nn.Parameter]) -> list[Found]:
    """The parameters these modules own, each with every (module, name) that holds it.

    Skips subtrees already given to ``fully_shard``; a parameter reached both
    here and through such a subtree (its sharded form, held here too) is rejected. One whose
    original an earlier ``fully_shard`` replaced is taken, as torch's FSDP2 takes it: the
    root's lazy init refuses it (``shared_with_other_groups``).
    """
    claimed: dict[int, str] = {}
    found: dict[int, Found] = {}

    def visit(module: nn.Module, prefix: str, top: bool) -> None:
        if _replicated(module):
            return  # torch's replicate() (DDP) owns these parameters, as torch's fully_shard leaves them
        state = get_state(module)
        if state is not None and not top:
            for group in state.groups:
                for p in group.params:
                    claimed[id(p.sharded)] = prefix or type(module).__name__
            return
        for name, param in module._parameters.items():
            if param is None or param in ignored:
                continue
            fqn = f"{prefix}{name}"
            if id(param) in found:
                found[id(param)][1].append((module, name))
            else:
                found[id(param)] = (param, [(module, name)], fqn)
        for name, child in module._modules.items():
            if child is not None:
                visit(child, f"{prefix}{name}.", False)

    for m in modules:
        visit(m, "", True)
    for param, _locations, fqn in found.values():
        owner = claimed.get(id(param))
        if owner is not None:
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is already sharded by {owner}; a parameter shared by two "
                "separately sharded modules cannot be sharded twice. Apply fully_shard to a common parent "
                "of both users (e.g. keep tied embedding and output weights in the root group), or pass it "
                "in ignored_params"
            )
    return list(found.values())


def shared_with_other_groups(found: list[Found]) -> list[tuple[str, str]]:
    """(fqn, the earlier call) of each parameter an earlier ``fully_shard`` already sharded: a
    parameter shared by modules sharded separately (tied embedding and output weights)."""
    return [(fqn, param.__dict__[_SHARDED_BY_ATTR]) for param, _locations, fqn in found
            if _SHARDED_BY_ATTR in param.__dict__]


def _check_devices(found: list[Found], mesh: DeviceMesh) -> None:
    devices = {param.device for param, _l, _f in found}
    if len(devices) > 1:
        listing = ", ".join(f"{fqn} on {param.device}" for param, _l, fqn in found)
        raise ValueError(
            f"fully_shard: parameters are on different devices ({listing}); move the module to one device "
            f"(module.to(...)) before sharding"
        )
    for device in devices:
        if device.type not in ("meta", "cpu", mesh.device_type):
            raise ValueError(
                f"fully_shard: parameters are on {device} but the mesh is on {mesh.device_type}; "
                f"move the module to {mesh.device_type} first, or build it on the meta device"
            )


def _move_buffers(modules: list[nn.Module], device: torch.device) -> None:
    """Buffers stay unsharded but live on the compute device, as parameters do."""
    for m in modules:
        for sub in m.modules():
            for name, buf in sub._buffers.items():
                if buf is not None and buf.device.type == "cpu":
                    sub._buffers[name] = buf.to(device)


def _check_tensor_parallel(found: list[Found], mesh: DeviceMesh, reshard_after_forward: Any) -> None:
    """DTensor parameters (tensor or expert parallelism) must be on a mesh that joins ``mesh``
    (``tp_mesh_of``): other axes of the same ranks, derived from one mesh."""
    dp_root = _compat.root_mesh(mesh)
    for param, _locations, fqn in found:
        if not isinstance(param, DTensor):
            continue
        tp_mesh = param.device_mesh
        if tp_mesh_of(tp_mesh, mesh) is None:  # by value, or joinable as torch joins them (see tp_mesh_of)
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is a DTensor on mesh {tp_mesh}, which cannot be joined with the "
                f"data-parallel mesh {mesh} (of {dp_root}): its axes must be other named axes of the same ranks, "
                "derived from one mesh. Build one mesh, e.g. init_device_mesh(device, (dp, tp), mesh_dim_names="
                "('dp', 'tp')) or world._unflatten(0, (dp, tp), ('dp', 'tp')), apply parallelize_module(block, "
                "mesh['tp'], plan) and then fully_shard(block, mesh=mesh['dp'])"
            )
        if not isinstance(reshard_after_forward, (bool, type(None))):
            raise ValueError(
                f"fully_shard: reshard_after_forward={reshard_after_forward} (int) is not supported with "
                f"tensor-parallel parameters ({fqn!r}); use True or False"
            )


def _compute_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    fsdp_cls = _FSDP_CLASSES.get(cls)
    if fsdp_cls is None:
        fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _FSDP_CLASSES[cls] = fsdp_cls
    module.__class__ = fsdp_cls


# As torch's ``fully_shard.state(module)``: what torch.distributed.pipelining reaches (_pipeline.py).
fully_shard.state = _pipeline.state  # type: ignore[attr-defined]

# One FSDP<Class> per original class, so isinstance checks and pickling by class stay stable.
_FSDP_CLASSES: dict[type, type] = {}
