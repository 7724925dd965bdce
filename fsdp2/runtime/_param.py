"""One parameter's life: sharded storage, the DTensor users see, the unsharded view.

A parameter of true shape ``(n, ...)`` sharded on tensor dim ``d`` over ``world``
ranks is split into ``world`` chunks of ``chunk = ceil(n / world)`` rows along
``d``. Each rank stores its chunk zero-padded to ``chunk`` rows, so every rank's
slice of a group's all-gather has the same size; the DTensor built on top
narrows the padding away and reports the true global shape.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

from .. import _compat
from .._format import chunk_rows
from . import _extension
from .._format import Chunking, contiguous_stride
from ._mesh import DataParallelMesh

__all__ = ["ShardedParam", "own_storage", "raise_if_on_meta"]


class ShardedParam:
    """A managed parameter: its padded local shard and its unsharded alias.

    ``sharded`` is the ``nn.Parameter`` (a DTensor ``Shard(dim)``) registered on
    the module outside forward/backward and stepped by the optimizer.
    ``unsharded`` is a plain ``nn.Parameter`` created at the first unshard as a
    view into the group's unsharded buffer; it is the same object every step
    (autograd's saved tensors and gradient accumulation refer to it), only its
    storage is freed and re-filled.
    """

    def __init__(
        self,
        param: nn.Parameter,
        locations: list[tuple[nn.Module, str]],
        fqn: str,
        dp: DataParallelMesh,
        dim: int,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        offload_to_cpu: bool,
        pin_memory: bool,
        device: torch.device,
    ) -> None:
        self.locations = locations
        self.fqn = fqn
        self.dp = dp
        self.rank = dp.shard_rank
        # Both forms' flag as of the last sync_requires_grad(): the user may freeze or
        # unfreeze either at any time; the group reads them whenever the module swaps forms.
        self.requires_grad = param.requires_grad
        self.global_shape = param.shape
        # Tensor parallelism: the parameter is already a DTensor on a TP mesh. FSDP shards
        # its TP-local tensor and adds the data-parallel axes in front.
        self.tp: tuple[DeviceMesh, tuple[Placement, ...]] | None = None
        if isinstance(param, DTensor):
            # The data-parallel root's own TP axes where they equal the parameter's mesh (see
            # _mesh.tp_mesh_of); dp_mesh_dims: the parameter's mesh is the whole SPMD mesh, kept.
            mesh = param.device_mesh if dp.spmd is not None else dp.tp_mesh(param.device_mesh)
            self.tp = (mesh or param.device_mesh, tuple(param.placements))
            local = param.to_local()
        else:
            local = param
        self.spmd_mesh, self.placements = self._spmd_layout(dim)
        self.layout = Chunking.even(local.shape, dim, dp.shard_size)
        # A local tensor subclass that gathers compact data (``_extension.py``); None for the rest.
        self.ext: _extension.ParamExtension | None = None
        if _extension.has_extension(local, fqn):  # checked by fully_shard (_extension.check_params)
            self.ext = _extension.ParamExtension(self, local)
        self._mp = (param_dtype, reduce_dtype)
        self.offload_to_cpu = offload_to_cpu
        self.pin_memory = pin_memory and torch.cuda.is_available()
        # QuantizedComm(error_feedback=True): what quantizing this rank's gradient lost last time
        # (fp32, the full padded size, rank-major); None until the first quantized reduction.
        self.grad_residual: torch.Tensor | None = None
        self._home_device = device
        self.unsharded: nn.Parameter | None = None
        self._on_grad_ready: Callable[[ShardedParam], None] | None = None  # the group's, set at bind
        self._grad_hooked = False  # the unsharded parameter's post-accumulate-grad hook is registered
        # Sum of unsynced gradients kept in reduce dtype (see ParamGroup.post_backward).
        self.accumulated_grad: torch.Tensor | None = None
        self._init_sharded(local.detach())

    def _spmd_layout(self, dim: int) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        """The mesh and placements of the sharded DTensor users see."""
        if self.tp is None:
            return self.dp.mesh, self.dp.placements(Shard(dim))
        if self.dp.spmd is not None:  # dp_mesh_dims: the parameter's own mesh, its shard axis now sharded
            return self.dp.spmd.sharded_layout(self.tp[0], self._placements_on_full_mesh(dim))
        tp_mesh, tp_placements = self.tp
        # Pieces TP already cut along ``dim``: the data-parallel chunks interleave with them.
        split = 1
        for axis, placement in enumerate(tp_placements):
            if isinstance(placement, Shard) and placement.dim == dim:
                split *= tp_mesh.size(axis)
        shard = _compat.strided_shard(dim, split) if split > 1 else Shard(dim)
        mesh = _compat.concat_meshes([self.dp.mesh, tp_mesh])
        return mesh, self.dp.placements(shard) + tp_placements

    def _placements_on_full_mesh(self, dim: int) -> tuple[Placement, ...]:
        """``dp_mesh_dims``: the parameter's placements with FSDP's shard on the shard axis.

        This rank holds its FSDP chunk of its TP-local tensor: the axes to the right of the
        shard axis that shard ``dim`` too cut first, so the chunks interleave with theirs.
        """
        mesh, placements = self.tp
        axis = self.dp.spmd.shard_axis
        split = 1
        for right in range(axis + 1, mesh.ndim):
            placement = placements[right]
            if isinstance(placement, Shard) and placement.dim == dim:
                split *= mesh.size(right)
        out = list(placements)
        out[axis] = _compat.strided_shard(dim, split) if split > 1 else Shard(dim)
        return tuple(out)

    # ---- dtypes -------------------------------------------------------------------------
    @property
    def orig_dtype(self) -> torch.dtype:
        return self.padded_local.dtype

    @property
    def param_dtype(self) -> torch.dtype:
        """dtype of the unsharded parameter and of the all-gather."""
        wanted = self._mp[0]
        return wanted if wanted is not None and self.orig_dtype.is_floating_point else self.orig_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self._mp[1] if self._mp[1] is not None else self.param_dtype

    # ---- sharded side -------------------------------------------------------------------
    def _init_sharded(self, full: torch.Tensor) -> None:
        """Cut this rank's chunk out of ``full`` into fresh padded storage."""
        layout, dim = self.layout, self.layout.dim
        rows = layout.rows(self.rank)
        if full.device.type == "meta":
            device = full.device
        else:  # a CPU-built model on an accelerator mesh moves there, as with torch's FSDP2
            device = torch.device("cpu") if self.offload_to_cpu else self._home_device
        if self.ext is not None:
            padded = self._cut_subclass(full, device)
        else:
            padded = torch.zeros(layout.local_shape, dtype=full.dtype, device=device)
            if rows > 0 and full.device.type != "meta":
                padded.narrow(dim, 0, rows).copy_(full.narrow(dim, self.rank * layout.chunk, rows))
        if self.pin_memory and device.type == "cpu":
            padded = padded.pin_memory()
        self._set_padded_local(padded)

    def _cut_subclass(self, full: torch.Tensor, device: torch.device) -> torch.Tensor:
        """This rank's padded chunk of an extension parameter, kept in its subclass.

        Only the ops such subclasses implement for torch's FSDP2 too: ``torch.chunk``,
        ``new_zeros``, a ``narrow`` along the shard dim and ``copy_``.
        """
        layout = self.layout
        rows = layout.rows(self.rank)
        with torch.no_grad():
            if full.device != device and full.device.type != "meta":
                full = full.to(device)
            pieces = torch.chunk(full, layout.world, dim=layout.dim)
            padded = full.new_zeros(layout.local_shape)
            if rows > 0 and full.device.type != "meta":
                padded.narrow(layout.dim, 0, rows).copy_(pieces[self.rank])
        return padded

    def _set_padded_local(self, padded: torch.Tensor) -> None:
        self.padded_local = padded
        local = padded.narrow(self.layout.dim, 0, self.layout.rows(self.rank))
        self.sharded = _compat.parameter(self.as_sharded_dtensor(local), self.requires_grad)
        self._register_on_modules(self.sharded)

    def as_sharded_dtensor(self, local: torch.Tensor) -> DTensor:
        shape = self.global_shape
        if local.device.type not in (self.spmd_mesh.device_type, "meta"):  # offloaded: stays on the host
            return _compat.dtensor_on(local, self.spmd_mesh, self.placements, shape, contiguous_stride(shape))
        return DTensor.from_local(
            local, self.spmd_mesh, self.placements, run_check=False,
            shape=shape, stride=contiguous_stride(shape),
        )

    def local_box(self) -> list[tuple[int, int]]:
        """``[(start, stop), ...]`` per dim: where this rank's sharded values sit in the global tensor.

        Tensor parallelism cuts first: each ``Shard(d)`` axis of the TP mesh splits the box
        along ``d`` into ceil-sized chunks (as ``torch.chunk``) and keeps this rank's. FSDP then
        keeps this rank's rows of that TP-local box. Replicate axes, HSDP's included, cut nothing.
        """
        box = [(0, size) for size in self.global_shape]
        if self.tp is not None:
            tp_mesh, tp_placements = self.tp
            for axis, placement in enumerate(tp_placements):
                if isinstance(placement, Shard):
                    start, stop = box[placement.dim]
                    chunk = chunk_rows(stop - start, tp_mesh.size(axis))
                    start = min(start + tp_mesh.get_local_rank(axis) * chunk, stop)
                    box[placement.dim] = (start, min(start + chunk, stop))
        layout = self.layout
        start = box[layout.dim][0] + min(self.rank * layout.chunk, layout.shape[layout.dim])
        box[layout.dim] = (start, start + layout.rows(self.rank))
        return box

    # ---- a parameter replaced on the module ---------------------------------------------
    def registered(self) -> object:
        """What the module holds now where this parameter was registered (its first name)."""
        module, name = self.locations[0]
        return module._parameters[name]

    def check_replacement(self, new: object, what: str) -> None:
        """Raise unless ``new`` can become this parameter's sharded form: a DTensor laid out as
        the current one (mesh, placements, global shape, this rank's local shape). ``what``
        names it in the error (the caller and the parameter or state-dict key)."""
        fix = ("build it as the current one is, e.g. nn.Parameter(distribute_tensor(full, param.device_mesh, "
               "param.placements)) for param = the module's parameter, or pass full tensors to "
               "load_state_dict (each rank keeps its rows)")
        if not isinstance(new, DTensor):
            raise TypeError(
                f"fsdp2: {what} is a {type(new).__name__}, but a fully_shard-ed parameter stays a DTensor "
                f"({self._layout_str(self.placements, self.spmd_mesh, self.global_shape)}); {fix}"
            )
        if new.device_mesh != self.spmd_mesh or tuple(new.placements) != self.placements \
                or new.shape != self.global_shape:
            raise ValueError(
                f"fsdp2: {what} is a DTensor {self._layout_str(new.placements, new.device_mesh, new.shape)}; "
                f"fsdp2 shards it {self._layout_str(self.placements, self.spmd_mesh, self.global_shape)}: {fix}"
            )
        box = [stop - start for start, stop in self.local_box()]
        if list(_compat.dtensor_local(new).shape) != box:
            raise ValueError(
                f"fsdp2: {what} holds a local tensor of shape {tuple(_compat.dtensor_local(new).shape)} on this rank, "
                f"where its layout puts {tuple(box)}; {fix}"
            )

    @staticmethod
    def _layout_str(placements: object, mesh: DeviceMesh, shape: torch.Size) -> str:
        names = f" {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""
        return f"{tuple(placements)} on mesh {tuple(mesh.shape)}{names}, shape {tuple(shape)}"

    def adopt_registered(self, move: bool) -> bool:
        """Make the parameter the module holds now the sharded one, re-padded (torch's
        ``reset_sharded_param``); returns whether anything changed.

        ``nn.Module._apply`` (``to_empty()``, ``.to()``, ``.double()``) replaces the local
        tensor or the whole parameter, ``load_state_dict(assign=True)`` and a plain
        ``module.name = nn.Parameter(dtensor)`` the parameter: the local tensor is copied into
        fresh padded storage (``move``: a new parameter's on this parameter's device, the CPU
        with offloading; else where it is), the parameter is registered under every name it
        has, and the unsharded parameter is rebuilt at the next unshard. Call
        ``check_replacement`` first.
        """
        current = self.registered()
        local, padded = _compat.dtensor_local(current), self.padded_local
        device = local.device
        if move and current is not self.sharded and not local.is_meta:  # (a conversion's device stays)
            device = torch.device("cpu") if self.offload_to_cpu else self._home_device
        # (A rank holding no rows of the parameter has an empty local tensor: no pointer to compare.)
        if current is self.sharded and local.dtype == padded.dtype and local.device == padded.device == device \
                and (local.is_meta or local.numel() == 0 or local.data_ptr() == padded.data_ptr()):
            return False
        dim, rows = self.layout.dim, self.layout.rows(self.rank)
        with torch.no_grad():
            if local.device != device:
                local = local.to(device)
            if self.ext is not None:  # keep the subclass (new_zeros dispatches to it)
                padded = local.new_zeros(self.layout.local_shape)
            else:
                padded = torch.zeros(self.layout.local_shape, dtype=local.dtype, device=device)
            if not local.is_meta:
                padded.narrow(dim, 0, rows).copy_(local)
        if self.pin_memory and padded.device.type == "cpu":
            padded = padded.pin_memory()
        self.padded_local = padded
        self._point_at_padded(current)
        self.sharded = current
        self.requires_grad = current.requires_grad
        self._register_on_modules(current)  # a tied parameter: every name holds it again
        self.unbind_unsharded()  # device or dtype may have changed
        return True

    def materialize(self) -> bool:
        """A shard still on the meta device gets storage of its own, zero-filled, where it lives
        (the compute device, or the CPU with offloading); the parameter object stays. Returns
        whether it was on meta."""
        if not self.padded_local.is_meta:
            return False
        device = torch.device("cpu") if self.offload_to_cpu else self._home_device
        if self.ext is not None:  # keep the subclass (new_zeros dispatches to it)
            padded = self.padded_local.new_zeros(self.layout.local_shape, device=device)
        else:
            padded = torch.zeros(self.layout.local_shape, dtype=self.padded_local.dtype, device=device)
        if self.pin_memory and padded.device.type == "cpu":
            padded = padded.pin_memory()
        self.padded_local = padded
        self._point_at_padded(self.sharded)
        self.unbind_unsharded()
        return True

    def _point_at_padded(self, param: DTensor) -> None:
        """Make ``param``'s local tensor the unpadded view of ``padded_local``, keeping the object.

        A DTensor carries its device apart from its local tensor's: where the device changes
        (the meta device to a real one), a new DTensor is swapped into the same object
        (``torch.utils.swap_tensors``), which keeps the hooks registered on it.
        """
        local = self.padded_local.narrow(self.layout.dim, 0, self.layout.rows(self.rank))
        if param.device == local.device:
            _compat.set_dtensor_local(param, local)
            return
        moved = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                   shape=param.shape, stride=param.stride())
        torch.utils.swap_tensors(param, _compat.parameter(moved, param.requires_grad))

    def unbind_unsharded(self) -> None:
        """Forget the unsharded parameter: the next unshard makes a new one (the group's buffers changed)."""
        self.unsharded = None
        self._grad_hooked = False

    def adopt_padded_local(self, slot: torch.Tensor) -> None:
        """Move the padded shard into ``slot`` (same shape and dtype) and keep it there.

        The registered DTensor parameter stays the same object (the optimizer
        holds it); only its local tensor becomes a view of ``slot``.
        """
        with torch.no_grad():
            slot.copy_(self.padded_local)
        self.padded_local = slot
        # (Detached, as torch's shard: a view of the padded shard's storage with no ``_base``.)
        _compat.set_dtensor_local(self.sharded, slot.narrow(self.layout.dim, 0, self.layout.rows(self.rank)).detach())

    def repad_from_local(self) -> None:
        """Rebuild the padded shard from the DTensor's current local tensor."""
        local = _compat.dtensor_local(self.sharded)
        padded = torch.zeros(self.layout.local_shape, dtype=local.dtype, device=local.device)
        with torch.no_grad():
            padded.narrow(self.layout.dim, 0, self.layout.rows(self.rank)).copy_(local)
        self.padded_local = padded

    # ---- unsharded side -----------------------------------------------------------------
    def bind_unsharded(self, region: torch.Tensor, on_grad_ready: Callable[[ShardedParam], None]) -> None:
        """Create the unsharded parameter as a view of ``region`` (once).

        ``region`` is this parameter's slice of the group's unsharded buffer,
        typed ``param_dtype`` and holding the padded full tensor.
        """
        if self.unsharded is not None:
            return
        padded_full = region.view(self.layout.padded_shape)
        self.bind_unsharded_tensor(padded_full.narrow(self.layout.dim, 0, self.layout.shape[self.layout.dim]),
                                   on_grad_ready)

    def bind_unsharded_tensor(self, tensor: torch.Tensor, on_grad_ready: Callable[[ShardedParam], None]) -> None:
        """Create the unsharded parameter from its (TP-local) unsharded tensor: a view of the
        group's buffer, or an extension's rebuilt tensor (a subclass, kept as the DTensor's local)."""
        if self.tp is not None:  # TP modules expect DTensor parameters on the TP mesh
            tp_mesh, tp_placements = self.tp
            with torch.no_grad():
                tensor = DTensor.from_local(
                    tensor, tp_mesh, tp_placements, run_check=False,
                    shape=self.global_shape, stride=contiguous_stride(self.global_shape),
                )
        self.unsharded = _compat.parameter(tensor, self.requires_grad)
        self._on_grad_ready, self._grad_hooked = on_grad_ready, False
        self._hook_grad_ready()

    def _hook_grad_ready(self) -> None:
        """Tell the group when autograd accumulated the unsharded gradient (trainable parameters only:
        a tensor that does not require grad takes no such hook, so a frozen one gets it when unfrozen)."""
        if self.requires_grad and not self._grad_hooked:
            # A weak reference: torch's garbage collector does not look into a tensor's
            # post-accumulate hooks, so a hook holding this object would keep it, its group and
            # the unsharded buffer alive forever once the model is deleted.
            self.unsharded.register_post_accumulate_grad_hook(functools.partial(_grad_ready, weakref.ref(self)))
            self._grad_hooked = True

    def sync_requires_grad(self) -> bool:
        """Follow a ``requires_grad`` change made on either form since the last call.

        The user changes the flag of whichever parameter the module holds at the time: the
        sharded one between steps, the unsharded one between forward and backward (the root's,
        or any group's after ``unshard()``). The form whose flag differs from the last one seen
        holds the change, and both forms take it (a flag is a bool: where both differ, they agree).
        Autograd reads the unsharded parameter's: a frozen parameter gets no gradient, an
        unfrozen one (with its gradient hook) gets one again from its next forward on.
        Returns whether it changed.
        """
        flag = self.requires_grad
        unsharded = self.unsharded
        if self.sharded.requires_grad == flag and (unsharded is None or unsharded.requires_grad == flag):
            return False
        flag = not flag
        self.requires_grad = flag
        if self.sharded.requires_grad != flag:
            self.sharded.requires_grad_(flag)
        if unsharded is not None:
            if unsharded.requires_grad != flag:
                unsharded.requires_grad_(flag)
            self._hook_grad_ready()
        return True

    def run_sharded_grad_hooks(self) -> None:
        """Run the hooks the user registered on the sharded parameter with
        ``register_post_accumulate_grad_hook``: its gradient shard is final.

        Autograd never runs them itself (it accumulates into the unsharded parameter).
        """
        _compat.run_post_accumulate_grad_hooks(self.sharded)

    def to_unsharded(self) -> None:
        assert self.unsharded is not None, "bind_unsharded() must run before to_unsharded()"
        self._register_on_modules(self.unsharded)

    def to_sharded(self) -> None:
        self._register_on_modules(self.sharded)

    def _register_on_modules(self, param: nn.Parameter) -> None:
        # Plain dict writes: nn.Module.__setattr__ would re-run its checks every step.
        for module, name in self.locations:
            module._parameters[name] = param

    # ---- gradients ----------------------------------------------------------------------
    def _unsharded_grad(self) -> torch.Tensor | None:
        """The unsharded parameter's gradient as a plain (TP-local) tensor."""
        grad = self.unsharded.grad if self.unsharded is not None else None
        if isinstance(grad, DTensor):
            tp_mesh, want = self.tp
            if self.dp.spmd is not None:  # the data-parallel axes' partial sums are FSDP's to reduce
                dp_axes = self.dp.spmd.dp_axes
                want = tuple(g if axis in dp_axes else t for axis, (g, t) in enumerate(zip(grad.placements, want)))
            if tuple(grad.placements) != want:  # e.g. Partial sums from TP
                grad = grad.redistribute(tp_mesh, want)
            grad = grad.to_local()
        return grad

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """The unsharded gradient to reduce (with any unsynced sum folded in); clears it."""
        grad = self._unsharded_grad()
        if self.unsharded is not None:
            self.unsharded.grad = None
        if self.accumulated_grad is not None:
            acc, self.accumulated_grad = self.accumulated_grad, None
            if grad is not None:
                acc += grad
            grad = acc
        return grad

    def zero_unsharded_grad(self) -> torch.Tensor:
        """Zeros shaped and typed as the unsharded gradient (TP-local): a gradient this rank did not produce."""
        with torch.no_grad():
            param = self.unsharded
            if self.ext is not None:  # a plain (TP-local) gradient, not the subclass zeros_like would make
                return torch.zeros(self.layout.shape, dtype=param.dtype, device=param.device)
            return torch.zeros_like(param.to_local() if isinstance(param, DTensor) else param)

    def stash_unsynced_grad(self) -> None:
        """Keep the gradient for a later synced backward, summed in reduce dtype."""
        if self.unsharded is None or self.unsharded.grad is None:
            return
        if self.reduce_dtype == self.param_dtype and self.accumulated_grad is None and self.tp is None:
            return  # autograd keeps accumulating into unsharded.grad itself
        grad = self._unsharded_grad()
        self.unsharded.grad = None
        if self.accumulated_grad is None:
            self.accumulated_grad = grad.to(self.reduce_dtype)
        else:
            self.accumulated_grad += grad

    def add_sharded_grad(self, reduced: torch.Tensor) -> None:
        """Add this rank's reduced chunk (``local_shape``) into the sharded ``.grad``.

        ``reduced`` is a slice of a reduce-scatter output allocated for this step
        alone, so a new ``.grad`` may keep a view of it instead of a copy.
        """
        # Per parameter per step: skip the dispatcher wherever a call would return its input.
        rows = self.layout.rows(self.rank)
        local = reduced if rows == self.layout.chunk else reduced.narrow(self.layout.dim, 0, rows)
        padded = self.padded_local
        move = local.dtype != padded.dtype or self.offload_to_cpu
        grad = self.sharded.grad
        if grad is None:
            if move:
                local = local.to(device=padded.device, dtype=padded.dtype)
            if rows != self.layout.chunk:
                local = local.contiguous()
            # Same mesh, placements, shape and dtype as the parameter: reuse its spec.
            self.sharded.grad = _compat.dtensor_like(self.sharded, local)
        else:
            with torch.no_grad():
                _compat.dtensor_local(grad).add_(local.to(padded.device) if move else local)


def register_forms(params: list[ShardedParam], unsharded: bool) -> bool:
    """Point the modules at each parameter's unsharded form (``unsharded``) or its sharded one,
    as ``to_unsharded`` / ``to_sharded`` do, in one loop for a group; returns whether any
    ``requires_grad`` flag differs from the last one seen (``ParamGroup.refresh_requires_grad``
    then follows it). Runs at each gather and reshard, per parameter: no call per parameter."""
    changed = False
    for p in params:
        flag, full, shard = p.requires_grad, p.unsharded, p.sharded
        if shard.requires_grad is not flag or (full is not None and full.requires_grad is not flag):
            changed = True
        form = full if unsharded else shard
        for module, name in p.locations:
            module._parameters[name] = form  # plain dict writes, as _register_on_modules
    return changed


def requires_grad_changed(params: list[ShardedParam]) -> bool:
    """Whether a form of some parameter has another ``requires_grad`` than the last one seen."""
    for p in params:
        flag, full = p.requires_grad, p.unsharded
        if p.sharded.requires_grad is not flag or (full is not None and full.requires_grad is not flag):
            return True
    return False


def raise_if_on_meta(params: list[ShardedParam], name_of: Callable[[ShardedParam], str]) -> None:
    """``RuntimeError`` (torch's type) naming the parameters still on the meta device, and the fix."""
    # (A home on meta: the memory planner's run, which computes there; no user's mesh is on meta.)
    names = [name_of(p) for p in params if p.padded_local.is_meta and p._home_device.type != "meta"]
    if names:
        listed = f"{names}" if len(names) <= 20 else f"{names[:20]} and {len(names) - 20} more"
        raise RuntimeError(
            f"fsdp2: parameters still on the meta device at their first use: {listed}. Materialize them first: "
            "model.to_empty(device=...) (after fully_shard it allocates only this rank's shards), then "
            "initialize them: reset_parameters() on each module, or load weights (load_state_dict, "
            "fsdp2.checkpoint.load_full, or set_model_state_dict(..., options=StateDictOptions("
            "full_state_dict=True, broadcast_from_rank0=True)), which materializes them itself)"
        )


def own_storage(view: torch.Tensor) -> torch.Tensor:
    """The same memory as ``view`` (a contiguous slot of a group's packed buffer) under a storage
    of its own that starts at the slot and holds only its bytes, keeping the buffer alive.

    A shard's local tensor then sits at storage offset 0 of a storage of the padded shard's
    size, as torch's FSDP2 shards do: ``torch.save`` / ``pickle`` of a DTensor needs that (a
    DTensor around a local tensor at a non-zero offset gets a non-zero data pointer, and torch
    pickles it as a plain tensor with the wrapper's storage, which has no data), and pickling
    copies the shard's bytes alone, not the whole buffer. DLPack (public, every dtype, every
    device) is torch's one way to make such an alias: no copy, the new storage's deleter keeps
    the buffer. A view of a parameter's slot (what users see) then is a view of that storage.
    The meta device (the memory planner's run) has no memory to alias, and DLPack's support of
    other devices than the CPU and CUDA (ROCm's too) varies by release: there the view stays.
    """
    if view.device.type not in ("cpu", "cuda"):
        return view
    try:
        return torch.from_dlpack(view)
    except (BufferError, RuntimeError, TypeError):  # a dtype DLPack has no code for (varies by release)
        return view


def _grad_ready(ref: weakref.ref, _unsharded: torch.Tensor) -> None:
    """An unsharded parameter's post-accumulate hook: tell its group (if the model still exists)."""
    param = ref()
    if param is not None:
        param._on_grad_ready(param)
