"""Parameters whose local tensor gathers compact data: torch's all-gather extension protocol.

A tensor subclass (torchao's float8 weights, NF4 for QLoRA, ...) may define two methods
that FSDP calls around its all-gather:

* ``fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)`` (or the
  older ``fsdp_pre_all_gather(self, mesh)``), called on the sharded local tensor before
  every all-gather, returns ``(inputs, metadata)``: the plain tensors to gather (e.g.
  int8 data and its scales) and anything the rebuild needs;
* ``fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None)`` gets each
  input gathered over the shard ranks, concatenated along dim 0 in rank order. The
  first time it returns ``(unsharded_tensor, inner_tensors_to_free)``; afterwards it is
  called with ``out=`` that same unsharded tensor (the parameter autograd knows) and
  refreshes it in place, the outputs being the same tensors (same storage) as before.

Sharded on a dim ``d`` other than 0 (evenly, as torch requires), each input holds the
shard's element count and stands for the rank's chunk of ``d``: the ranks' inputs are laid
side by side along ``d`` (the entry is laid out as the parameter), and the rebuild gets that
full tensor viewed with the input's trailing dims, as torch hands it. Under tensor
parallelism the subclass is the TP DTensor's local tensor; the hooks see its FSDP shard and
the TP-local shape, and the rebuilt tensor becomes the local tensor of the unsharded
DTensor on the TP mesh, which later calls get as ``out=`` (torch's choices, all three).

How it fits fsdp2's layout: each input is one more entry of the group's all-gather,
laid out as a dim-0 sharded tensor of its own (``Chunking`` with the input's shape as
the local shape), so the byte slice, the unsharded buffer and every transport (flat,
exchange, reads) carry it like any parameter. Each input's gathered output is a tensor of
its own at storage offset 0, as torch's all-gather outputs are (a rebuild may pair outputs,
``TwoTensor`` requires equal offsets); the group frees its storage at reshard and
re-allocates it before the next gather, so it keeps its storage object across gathers
(subclasses check that ``out``'s data is the all-gather output). Inner tensors the subclass
allocated itself are freed (storage resized to 0) at reshard and re-allocated before the
next ``out=`` call, as torch does. A group holding no such parameter has no
``GroupExtension`` and takes none of these paths.

The methods may be attached after ``fully_shard`` to the sharded local tensor object
itself (instance methods, on a plain tensor too): the group looks for them again at lazy
init and after a module conversion (``to_empty()`` makes new local tensors, without hooks
attached to the old ones), as torch does at its lazy init (``refresh_params``). A subclass
parameter whose class has no hooks at ``fully_shard`` is sharded as a plain tensor, so hooks
added to that class later are not seen (torch keeps the subclass).

Mixed precision does not cast these inputs: ``param_dtype`` is handed to the rebuild.
Gradients of the unsharded tensor are plain tensors, reduced like any other.
"""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .. import _format
from .. import _compat, _wire
from ._shapes import ParamShape

if TYPE_CHECKING:
    from ._mesh import DataParallelMesh

__all__ = ["PRE", "POST", "has_extension", "ParamExtension", "GroupExtension"]

PRE, POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"
_SIGNATURE = (f"{PRE}(self, mesh, outer_size, outer_stride, module, mp_policy) -> (inputs, metadata), "
              f"or the older {PRE}(self, mesh)")


def has_extension(local: torch.Tensor, fqn: str) -> bool:
    """Whether ``local`` (a parameter's local tensor) defines the extension; both methods or neither."""
    pre, post = hasattr(local, PRE), hasattr(local, POST)
    if pre != post:
        have, missing = (PRE, POST) if pre else (POST, PRE)
        raise TypeError(
            f"fully_shard: parameter {fqn!r} is a {type(local).__name__} that defines {have} but not {missing}; "
            f"define both ({PRE} returns the tensors to all-gather, {POST} rebuilds the unsharded tensor "
            "from them) or neither"
        )
    return pre


def check_params(found: Sequence[tuple[torch.nn.Parameter, Any, str]], dims: Sequence[int], shard_size: int,
                 reshard_after_forward: bool | int | None) -> None:
    """``fully_shard``'s checks of the parameters that define the extension, before any change.

    What is supported: both methods, a pre-all-gather of 1 or 5 arguments, data-parallel and
    tensor-parallel (DTensor) parameters, sharding on any dim that ``shard_size`` (the shard
    axis's size) divides evenly when it is not dim 0, and a bool ``reshard_after_forward``, as
    in torch. ``found``: (parameter, its places, FQN) per parameter; ``dims``: each one's shard dim.
    """
    for (param, _locations, fqn), dim in zip(found, dims):
        local = _compat.dtensor_local(param) if isinstance(param, DTensor) else param
        if has_extension(local, fqn):
            _check_one(local, fqn, local.shape, dim, shard_size, reshard_after_forward)


def _check_one(local: torch.Tensor, fqn: str, shape: torch.Size, dim: int, shard_size: int,
               reshard_after_forward: bool | int | None) -> None:
    """The checks of one parameter whose local tensor defines the extension; ``shape``: its
    unsharded (TP-local for a DTensor) shape."""
    _pre_arity(local, fqn)
    name = type(local).__name__
    # The rebuilt tensor is laid over the gathered outputs as a contiguous tensor of the
    # parameter's shape (as torch does): padding in the middle of a dim other than 0 has no place there.
    if dim != 0 and shape[dim] % shard_size:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} ({name}, which defines {PRE}) is sharded on dim {dim} of size "
            f"{shape[dim]}, which {shard_size} shards do not divide; a parameter using the all-gather "
            f"extension is sharded on a dim other than 0 only evenly (as in torch): return Shard(0) from "
            "shard_placement_fn for it, or a dim the shard count divides"
        )
    if not isinstance(reshard_after_forward, bool) and reshard_after_forward is not None:
        raise NotImplementedError(
            f"fully_shard: reshard_after_forward as an int is not supported with parameters that define "
            f"{PRE} ({fqn!r}, a {name}), as in torch; use True or False"
        )


def refresh_params(params: Sequence[ParamShape], reshard_after_forward: bool | int | None) -> bool:
    """Follow the methods defined on (or removed from) the sharded local tensors since ``fully_shard``.

    The hooks may be attached after ``fully_shard`` to the local tensor object itself (which
    ``to_empty()`` replaces), as torch allows: the group looks again at lazy init and after a
    module conversion. Returns whether any parameter changed side;
    the ones that gained the methods pass ``fully_shard``'s checks first, all or none changing.
    """
    found = []
    for p in params:
        local = _compat.dtensor_local(p.sharded)
        if has_extension(local, p.fqn) != (p.ext is not None):
            found.append((p, local))
    for p, local in found:
        if p.ext is None:
            _check_one(local, p.fqn, p.layout.shape, p.layout.dim, p.layout.world, reshard_after_forward)
    for p, local in found:
        p.ext = ParamExtension(p, local) if p.ext is None else None
    return bool(found)


def _pre_arity(local: torch.Tensor, fqn: str) -> int:
    """How many arguments ``local.fsdp_pre_all_gather`` takes: 1 (mesh) or 5 (as torch detects)."""
    count = len(inspect.signature(getattr(local, PRE)).parameters)
    if count not in (1, 5):
        raise TypeError(
            f"fully_shard: parameter {fqn!r}: {type(local).__name__}.{PRE} takes {count} arguments; "
            f"define it as {_SIGNATURE}"
        )
    return count


class ParamExtension:
    """One parameter's extension state: the hooks' results between an all-gather and its rebuild.

    ``specs`` (shape and dtype of each input, fixed at the first all-gather) lay out the
    group's all-gather format; ``outputs`` are the persistent tensors the inputs are gathered into (one
    storage each); ``to_free`` the inner tensors outside them (with their sizes).
    """

    def __init__(self, p: ParamShape, local: torch.Tensor) -> None:
        self.param = p
        self.cls = type(local).__name__
        self.arity = _pre_arity(local, p.fqn)
        self.specs: tuple[tuple[torch.Size, torch.dtype], ...] | None = None
        self.inputs: list[torch.Tensor] = []  # this all-gather's, until it is issued
        self.metadata: Any = None
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.to_free: list[tuple[torch.Tensor, int]] = []

    # ---- before the all-gather ---------------------------------------------------------
    def pre_all_gather(self, mesh: DeviceMesh, module: torch.nn.Module, mp_policy: Any,
                       device: torch.device) -> list[torch.Tensor]:
        """Run the subclass's pre-all-gather on the sharded local tensor; check and keep its inputs."""
        p = self.param
        local = _compat.dtensor_local(p.sharded)
        if local.device != device:  # CPU offload: the hook sees the tensor on the compute device
            local = local.to(device, non_blocking=True)
        hook = getattr(local, PRE)
        shape = p.layout.shape
        with torch.no_grad():
            result = hook(mesh) if self.arity == 1 else \
                hook(mesh, shape, _format.contiguous_stride(shape), module, mp_policy)
        inputs, self.metadata = self._check_pre(result, device)
        specs = tuple((_entry_shape(t), t.dtype) for t in inputs)
        if self.specs is None:
            self._check_dim(specs)
            self.specs = specs
        elif specs != self.specs:
            raise ValueError(
                f"fsdp2: {self.cls}.{PRE} of parameter {p.fqn!r} returned inputs {_describe(specs)}, but "
                f"{_describe(self.specs)} at the first all-gather; return the same shapes and dtypes every "
                "time (the group's all-gather layout and the persistent outputs are built from the first)"
            )
        if p.layout.dim == 0:
            self.inputs = [t.reshape(_entry_shape(t)) for t in inputs]
        else:  # each input is a piece of the dim-d chunk: sent as one, gathered along dim d
            self.inputs = [t.reshape(p.layout.local_shape) for t in inputs]
        return self.inputs

    def _check_dim(self, specs: Sequence[tuple[torch.Size, torch.dtype]]) -> None:
        """Sharded on a dim other than 0: every input has the padded shard's element count.

        Each rank's input stands for its chunk of that dim: the gather lays the ranks' inputs
        side by side along it (torch's layout), which only an input of the chunk's size can be.
        """
        p = self.param
        local = p.layout.local_shape
        if p.layout.dim != 0 and any(math.prod(shape) != math.prod(local) for shape, _ in specs):
            raise ValueError(
                f"fsdp2: {self.cls}.{PRE} of parameter {p.fqn!r} (sharded on dim {p.layout.dim}) returned inputs "
                f"{_describe(specs)}; sharded on a dim other than 0, each input must hold as many elements as "
                f"the shard {tuple(local)} (e.g. the shard in another dtype), as with torch's fully_shard: "
                "the ranks' inputs are laid side by side along that dim. Shard it on dim 0 for other inputs"
            )

    def _check_pre(self, result: Any, device: torch.device) -> tuple[list[torch.Tensor], Any]:
        where = f"{self.cls}.{PRE} of parameter {self.param.fqn!r}"
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise TypeError(f"fsdp2: {where} returned {type(result).__name__}; return a pair (inputs, metadata), "
                            "inputs being a tuple of plain tensors to all-gather")
        inputs, metadata = result
        if not isinstance(inputs, (tuple, list)) or not inputs:
            raise TypeError(f"fsdp2: {where} returned inputs of type {type(inputs).__name__}; return a non-empty "
                            "tuple of plain tensors (e.g. (data, scale)) as the first item")
        for i, t in enumerate(inputs):
            if type(t) is not torch.Tensor:  # noqa: E721 - the bytes of a subclass are not its values
                raise TypeError(f"fsdp2: {where} returned input {i} of type {type(t).__name__}; return plain "
                                "torch.Tensors (the subclass's inner data), not tensor subclasses")
            if t.device != device:
                raise ValueError(f"fsdp2: {where} returned input {i} on {t.device}; return it on the compute "
                                 f"device {device}")
        return [t.detach() for t in inputs], metadata

    # ---- after the all-gather ----------------------------------------------------------
    def bind_outputs(self, outputs: Sequence[torch.Tensor]) -> None:
        """Keep the tensors each input is gathered into (persistent: same objects, same storages)."""
        self.outputs = tuple(outputs)

    def post_all_gather(self, on_grad_ready: Callable[[ParamShape], None]) -> None:
        """Rebuild the unsharded tensor from ``outputs``: created the first time, refreshed with ``out=`` after."""
        p = self.param
        local = _compat.dtensor_local(p.sharded)
        hook = getattr(local, POST)
        metadata, self.metadata, self.inputs = self.metadata, None, []
        with torch.no_grad():
            if p.unsharded is not None:
                for t, nbytes in self.to_free:
                    t.untyped_storage().resize_(nbytes)
                hook(self.outputs, metadata, p.param_dtype, out=p.unsharded)
                return
            result = hook(self.outputs, metadata, p.param_dtype)
        tensor, inner = self._check_post(result)
        shape = p.layout.shape
        if tensor.shape != shape:  # the padded rows (uneven sharding) are not part of the parameter
            tensor = torch.as_strided(tensor, shape, _format.contiguous_stride(shape), 0)
        gathered = {t.untyped_storage().data_ptr() for t in self.outputs}  # freed and re-allocated by the group
        self.to_free = [(t, t.untyped_storage().nbytes()) for t in inner
                        if t.untyped_storage().data_ptr() not in gathered]
        p.bind_unsharded_tensor(tensor, on_grad_ready)

    def _check_post(self, result: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        p = self.param
        where = f"{self.cls}.{POST} of parameter {p.fqn!r}"
        fix = "return (unsharded_tensor, inner_tensors_to_free) when out is None"
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise TypeError(f"fsdp2: {where} returned {type(result).__name__}; {fix}")
        tensor, inner = result
        if not isinstance(tensor, torch.Tensor) or not isinstance(inner, (tuple, list)) \
                or not all(isinstance(t, torch.Tensor) for t in inner):
            raise TypeError(f"fsdp2: {where} returned ({type(tensor).__name__}, {type(inner).__name__}); {fix} "
                            "(a tensor and a tuple of tensors)")
        padded = p.layout.padded_shape
        # Sharded on another dim, the outputs keep their inputs' trailing dims (as torch hands
        # them): a rebuild of their shape holds the parameter's elements in order, and is taken as it.
        flat = p.layout.dim != 0 and tensor.numel() == math.prod(padded) and tensor.is_contiguous()
        if tensor.shape not in (padded, p.layout.shape) and not flat:
            raise ValueError(
                f"fsdp2: {where} returned a tensor of shape {tuple(tensor.shape)}; the unsharded parameter is "
                f"{tuple(p.layout.shape)} ({tuple(padded)} with the padding rows of uneven sharding): rebuild "
                "it from the gathered outputs, each the inputs of every rank concatenated along dim 0"
                + ("" if p.layout.dim == 0 else f" (here laid side by side along dim {p.layout.dim}, then viewed with "
                   "the inputs' trailing dims)")
            )
        return tensor, tuple(inner)

    def free(self) -> None:
        """Reshard: free the inner tensors the subclass allocated outside the unsharded buffer."""
        for t, _nbytes in self.to_free:
            t.untyped_storage().resize_(0)


def _entry_shape(t: torch.Tensor) -> torch.Size:
    """The shape an input is gathered as: a 0-d input is one element per rank."""
    return t.shape if t.dim() > 0 else torch.Size([1])


def _describe(specs: Sequence[tuple[torch.Size, torch.dtype]]) -> str:
    return "(" + ", ".join(f"{tuple(s)} {str(d).removeprefix('torch.')}" for s, d in specs) + ")"


class GroupExtension:
    """The extension side of one group: which entries of its all-gather belong to which parameter.

    The all-gather's entries are, in parameter order, a plain parameter's padded shard, or
    each input of an extension parameter. Built only for groups holding such a parameter.
    """

    def __init__(self, params: Sequence[ParamShape], dp: DataParallelMesh) -> None:
        self.params = params
        # The shard axis's 1-D mesh (HSDP: the last axis), as the hooks expect.
        self.mesh = dp.mesh if dp.mesh.ndim == 1 else dp.mesh[dp.mesh.mesh_dim_names[-1]]
        self.pg = dp.shard_group
        self.agreed = False  # the ranks compared their inputs' shapes (once, at the first all-gather)
        self.sources: list[torch.Tensor] = []
        self.gathered: list[torch.Tensor] = []  # the inputs' gathered outputs, one storage each (bind)

    @classmethod
    def of(cls, params: Sequence[ParamShape], dp: DataParallelMesh, partial: bool) -> GroupExtension | None:
        if all(p.ext is None for p in params):
            return None
        assert not partial, "fully_shard refuses an int reshard_after_forward here (check_params)"
        return cls(params, dp)

    @property
    def known(self) -> bool:
        """Every extension parameter's inputs are known (after the first all-gather's hooks)."""
        return all(p.ext is None or p.ext.specs is not None for p in self.params)

    def pre_all_gather(self, mp_policy: Any, device: torch.device) -> None:
        """Run every extension parameter's pre-all-gather; ``sources`` then holds the entries to send."""
        sources = []
        for p in self.params:
            if p.ext is None:
                sources.append(p.padded_local)
            else:
                sources += p.ext.pre_all_gather(self.mesh, p.locations[0][0], mp_policy, device)
        if not self.agreed:
            self._agree()
        self.sources = sources

    @_compat.outside_dispatch_modes()  # bookkeeping, not the group's all-gather (CommDebugMode)
    def _agree(self) -> None:
        """Check once that every rank gathers inputs of the same shapes (collective on the shard group).

        A rank whose inputs differ (uneven sharding that a hook did not pad) would otherwise
        make the collective fail or hang on some ranks only.
        """
        mine = [(p.fqn, _describe(p.ext.specs)) for p in self.params if p.ext is not None]
        for rank, theirs in enumerate(_wire.all_gather_json(mine, pg=self.pg)):  # no numpy needed
            for (fqn, spec), (_, other) in zip(mine, theirs):
                if spec != other:
                    p = next(q for q in self.params if q.fqn == fqn)
                    raise ValueError(
                        f"fsdp2: {p.ext.cls}.{PRE} of parameter {fqn!r} returned inputs {spec} on shard rank "
                        f"{dist.get_rank(self.pg)} but {other} on shard rank {rank}: every rank must gather the "
                        "same shapes; with uneven sharding, pad the inputs to the padded shard "
                        f"({tuple(p.layout.local_shape)} rows and all; outer_size and the mesh give it)"
                    )
        self.agreed = True

    def entries(self, world: int) -> tuple[list[_format.Chunking], list[torch.dtype]]:
        """The layouts and dtypes of the all-gather's entries over ``world`` ranks."""
        layouts, dtypes = [], []
        for p in self.params:
            if p.ext is None:
                layouts.append(p.layout.with_world(world))
                dtypes.append(p.param_dtype)
                continue
            for shape, dtype in p.ext.specs:
                if p.layout.dim == 0:  # the ranks' inputs one after the other
                    layouts.append(_format.Chunking(torch.Size([world * shape[0], *shape[1:]]), 0, world, shape[0]))
                else:  # side by side along the dim, as the parameter's chunks (_check_dim: same element count)
                    layouts.append(p.layout.with_world(world))
                dtypes.append(dtype)
        return layouts, dtypes

    def _inputs(self) -> list[bool]:
        """Per entry of the all-gather: whether it is an extension parameter's input."""
        return [is_input for p in self.params
                for is_input in ([False] if p.ext is None else [True] * len(p.ext.specs))]

    def region_bytes(self, world: int) -> list[int]:
        """Bytes of each entry's region in the unsharded buffer: none for an input, whose
        gathered output has a storage of its own (``bind``)."""
        layouts, dtypes = self.entries(world)
        return [0 if is_input else math.prod(lay.padded_shape) * dtype.itemsize
                for lay, dtype, is_input in zip(layouts, dtypes, self._inputs())]

    def output_bytes(self, world: int) -> int:
        """Bytes of the inputs' gathered outputs, outside the unsharded buffer."""
        layouts, dtypes = self.entries(world)
        return sum(math.prod(lay.padded_shape) * dtype.itemsize
                   for lay, dtype, is_input in zip(layouts, dtypes, self._inputs()) if is_input)

    def bind(self, buffer: torch.Tensor, param_base: torch.Tensor, starts: Sequence[int], sizes: Sequence[int],
             fmt: Any, on_grad_ready: Callable[[ParamShape], None]) -> list[torch.Tensor]:
        """One region per entry of ``fmt``, where the all-gather writes it; returns them.

        A plain parameter's region is its place in the unsharded buffer (at ``starts``) and
        its unsharded view is taken from ``param_base`` (the buffer's ``.data``, without its
        version counter). An extension input's gathered output is a tensor of its own at
        storage offset 0, as torch's all-gather outputs are: a rebuild may pair outputs that
        must sit at equal offsets (``TwoTensor`` checks that). The hooks get their ``.data``,
        which refilling does not bump the version counter of.
        """
        layouts, dtypes = fmt.layouts, fmt.dtypes
        regions: list[torch.Tensor] = []
        self.gathered = []
        for p in self.params:
            i = len(regions)
            if p.ext is None:
                lay, dtype, start, size = layouts[i], dtypes[i], starts[i], sizes[i]
                regions.append(buffer[start:start + size].view(dtype).view(lay.padded_shape))
                p.bind_unsharded(param_base[start:start + size].view(dtype).view(lay.padded_shape), on_grad_ready)
                continue
            n = len(p.ext.specs)
            own = [torch.empty(lay.padded_shape, dtype=dtype, device=buffer.device)
                   for lay, dtype in zip(layouts[i:i + n], dtypes[i:i + n])]
            # The rebuild gets each output with its input's trailing dims (for dim 0, its own shape).
            p.ext.bind_outputs([t.data if t.shape[1:] == shape[1:] else t.data.view(-1, *shape[1:])
                                for t, (shape, _dtype) in zip(own, p.ext.specs)])
            self.gathered += own
            regions += own
        return regions

    def alloc(self) -> None:
        """Unshard: the storages of the gathered outputs again (freed at the last reshard)."""
        for t in self.gathered:
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(t.numel() * t.element_size())

    def post_all_gather(self, on_grad_ready: Callable[[ParamShape], None]) -> None:
        self.sources = []
        for p in self.params:
            if p.ext is not None:
                p.ext.post_all_gather(on_grad_ready)

    def free(self) -> None:
        """Reshard: the gathered outputs' storages and the inner tensors the rebuilds allocated."""
        for t in self.gathered:
            t.untyped_storage().resize_(0)
        for p in self.params:
            if p.ext is not None:
                p.ext.free()

    def held(self) -> list[torch.Tensor]:
        """The unsharded-side tensors outside the group's buffer (the memory tracker's)."""
        return self.gathered + [t for p in self.params if p.ext is not None for t, _ in p.ext.to_free]

    def reset(self) -> None:
        """After ``nn.Module._apply`` (devices or dtypes changed): outputs and rebuilt tensors are stale."""
        self.sources, self.gathered = [], []
        for p in self.params:
            if p.ext is not None:
                p.ext.outputs, p.ext.to_free, p.ext.inputs, p.ext.metadata = (), [], [], None
