"""A group of parameters gathered, freed and reduced together, and its state machine.

One ``fully_shard`` call makes one group. The group owns a persistent
*unsharded buffer* (parameter-major; every unsharded parameter is a view of
it) whose storage is allocated on unshard and released on reshard, so the
parameter objects autograd refers to never change.

A group whose modules hold other groups (the root) keeps that buffer from
forward to the end of backward, as torch's FSDP2; with ``set_early_release`` it
reduces its final gradients early and frees the buffer a part at a time
(``EarlyRelease``, ``_release.py``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from .. import _compat
from .._common import ShardState
from ..diagnostics import _debug, _trace
from . import _checks
from ..comm._collectives import AllGatherInFlight, GatherTargets
from ..comm._transport import Transport, choose_transport
from . import _extension
from ._extension import GroupExtension
from .._format import GatherFormat, segment_layout
from ._mesh import DataParallelMesh, SubGroup
from ._param import ShardedParam, own_storage, raise_if_on_meta, register_forms, requires_grad_changed
from ._policy import GroupPolicy
from ._release import EarlyRelease, segment_bounds
from ._reduce_queue import ReduceQueue
from . import _reduction


__all__ = ["ShardState", "ParamGroup", "ReduceQueue", "SubGroup"]


class ParamGroup:
    def __init__(
        self,
        params: list[ShardedParam],
        dp: DataParallelMesh,
        device: torch.device,
        subgroup: SubGroup | None,
    ) -> None:
        self.params = params
        self.dp = dp
        self.process_group = dp.shard_group
        self.world = dp.shard_size
        self.device = device
        self.subgroup = subgroup
        self.label = type(params[0].locations[0][0]).__name__  # the FQN once lazy init knows the root
        self.reduce_queue = ReduceQueue()  # replaced by the root's shared queue at lazy init
        self.root = None  # the root's RootContext, set at lazy init (iteration, phase, checks)
        self.policy = GroupPolicy()  # written by fully_shard and the FSDPModule setters
        self.partial_sums: dict[torch.dtype, torch.Tensor] = {}  # HSDP: reduce-scattered sums awaiting all-reduce
        self.state = ShardState.SHARDED
        self._gather: AllGatherInFlight | None = None
        self._unreleased: AllGatherInFlight | None = None  # a read all-gather the peers may still read from
        self._partial_send: torch.Tensor | None = None
        self._header_pg: dist.ProcessGroup | None = None  # the all-gather in flight's, when its headers are checked
        self.header_slot: _checks.HeaderSlot | None = None  # its all-gather header, rewritten in place (CPU)
        # The unsharded buffer: one storage per segment, parameters ``bounds[k]:bounds[k + 1]``
        # in segment ``k``; several only for early frees (_segment_bounds_for).
        self._buffers: list[torch.Tensor] = []
        self._bounds = [0, len(params)]
        # A group whose modules hold other groups (the root): set at lazy init.
        self.early: EarlyRelease | None = None
        self._regions: list[torch.Tensor] = []
        self._chunk_views: dict[int, GatherTargets] = {}  # world -> the regions as (world, *local_shape)
        self._formats: dict[int, GatherFormat] = {}
        self._quantized: dict[int, GatherFormat] = {}  # world -> the quantized slice (QuantizedComm weights)
        # The shards packed back to back in the all-gather's send layout (None when a
        # cast or a device move makes a copy-in necessary anyway): see _pack_shards.
        self._packed: torch.Tensor | None = None
        self._packed_slots: list[torch.Tensor] = []  # each parameter's place in ``_packed``
        self._packed_ptrs: list[int] = []  # the DTensors' local data pointers once packed
        # Per-backward bookkeeping.
        self.backward_started = False
        self.post_backward_done = False
        self._grads_ready: set[int] = set()
        self._count_trainable()
        # Forwards whose inputs' gradients backward has yet to compute (groups that wait for
        # them, see waits_for_inputs): one token each, held by the autograd graph, so a graph
        # dropped without a backward (an evaluation with gradients on) drops out by itself.
        self.inputs_pending: weakref.WeakSet[Any] = weakref.WeakSet()
        # A forward of this iteration did not route its inputs through _InputsGradReady (none
        # required grad, or the group had no frozen parameter then): nothing tells when backward
        # is done with the parameters frozen at or since that forward, so the end of backward
        # reduces them (as torch's FSDP2 does).
        self.unhooked_forward = False
        # fully_shard([a, b]): a forward may run some of the modules only (set by ModuleState).
        self.several_modules = False
        # Parameters whose local tensor subclass gathers compact data (_extension.py); None if none do.
        self._ext = GroupExtension.of(params, dp, subgroup is not None)
        # How the bytes move (comm/_transport.py): chosen for the group's size and device; a
        # custom comm makes its collective flat (gather_transport / reduce_transport).
        self.transport: Transport = choose_transport(device, self._unsharded_bytes())
        self.refresh_transports()
        self._probed = False  # probe_transport() ran: at the group's first all-gather
        self.prepared = False  # the parameters assigned since fully_shard were taken (take_assigned)
        self.shards_are_full = self._shards_are_the_full_tensors()
        self._pack_shards()

    # ---- layout -------------------------------------------------------------------------
    def _gather_format(self, world: int) -> GatherFormat:
        if world not in self._formats:
            if self._ext is not None:  # one entry per extension input (known once its hook ran)
                layouts, dtypes = self._ext.entries(world)
            else:
                layouts = [p.layout.with_world(world) for p in self.params]
                dtypes = [p.param_dtype for p in self.params]
            self._formats[world] = GatherFormat.build(layouts, dtypes)
        return self._formats[world]

    def _quantized_format(self, world: int) -> GatherFormat:
        """The all-gather's slice with the weights quantized (``QuantizedComm``): the entries of
        ``_gather_format``, each floating-point one as int8 values and per-block scales."""
        fmt = self._quantized.get(world)
        if fmt is None:
            if self._ext is not None:  # found at lazy init: fully_shard refuses those it sees
                raise ValueError(
                    f"fsdp2: group {self.label} has parameters whose tensor subclass gathers its own data "
                    f"(fsdp_pre_all_gather), which comm_policy=QuantizedComm(weights='int{self.policy.weight_bits}') "
                    "cannot quantize; shard them in a fully_shard call without comm_policy (or with weights=None)"
                )
            raw = self._gather_format(world)
            fmt = self._quantized[world] = raw if world == 1 else GatherFormat.build(
                raw.layouts, raw.dtypes, self.policy.weight_block, self.policy.weight_bits)  # one rank: nothing sent
        return fmt

    def adopt_registered(self, move: bool, where: str) -> None:
        """Take the parameters the modules hold now as the group's sharded ones (torch's
        ``reset_sharded_param``): after ``nn.Module._apply``, ``load_state_dict(assign=True)``,
        or a parameter assigned before the first forward. Every one is checked before any is
        taken (``where`` names the caller in errors); the buffers are rebuilt if one changed.
        ``move``: put replacing parameters on the group's device (see ``ShardedParam.adopt_registered``).
        """
        if self.state is not ShardState.SHARDED:
            raise RuntimeError(f"group {self.label} must be resharded before its parameters are replaced")
        for p in self.params:
            p.check_replacement(p.registered(), f"parameter {self._name_of(p)!r} ({where})")
        if any([p.adopt_registered(move) for p in self.params]):  # a list: adopt every parameter
            self.invalidate()

    def materialize(self) -> None:
        """Shards still on the meta device get zero-filled storage of their own (the checkpoint
        helpers, before filling them); the parameter objects stay."""
        self.reshard()
        if any([p.materialize() for p in self.params]):  # a list: every parameter
            self.invalidate()

    def take_assigned(self) -> None:
        """Before the group's first gather: take the parameters the user assigned since
        ``fully_shard`` (``module.w = nn.Parameter(dtensor)``) and the all-gather extensions
        attached to the shards since, as torch's FSDP2 does at lazy init."""
        if not self.prepared and self.state is ShardState.SHARDED:
            self.adopt_registered(True, "at its first use")
            self.find_extensions()  # hooks attached since fully_shard (to_empty() made new tensors)

    def prepare(self) -> None:
        """An explicit ``unshard()``, which may come before the root's lazy init: take the
        parameters assigned since ``fully_shard`` and refuse parameters still on the meta device."""
        self.take_assigned()
        raise_if_on_meta(self.params, self._name_of)
        self.prepared = True

    def find_extensions(self) -> None:
        """Lazy init and module conversions: take up the all-gather extension methods attached
        to (or removed from) the sharded local tensors since ``fully_shard`` (``_extension.py``)."""
        if self.state is not ShardState.SHARDED:
            return  # gathered or gathering (an explicit unshard before the first forward): as built
        if _extension.refresh_params(self.params, self.policy.reshard_after_forward):
            self._ext = GroupExtension.of(self.params, self.dp, self.subgroup is not None)
            self.invalidate()

    def compute_on_meta(self) -> None:
        """The memory planner's run (``memory/_simulate.py``): every buffer of this group on meta."""
        self.device = torch.device("meta")
        for p in self.params:
            p._home_device = self.device  # (raise_if_on_meta lets these shards through)
        self.invalidate()

    def invalidate(self) -> None:
        """Forget buffers and plans after devices or dtypes changed (``nn.Module._apply``) or
        parameters were replaced."""
        if self.state is not ShardState.SHARDED:
            raise RuntimeError(f"group {self.label} must be resharded before converting its module")
        self._formats.clear()
        self._quantized.clear()
        self._buffers, self._regions = [], []
        for p in self.params:  # their views of the old buffers go too
            p.unbind_unsharded()
        self._chunk_views.clear()
        self._count_trainable()
        if self._ext is not None:
            self._ext.reset()
        self.transport = choose_transport(self.device, self._unsharded_bytes())  # the dtypes may have changed
        self.refresh_transports()
        self._probed = False  # an exchange group now (the dtypes changed) probes at its next gather
        self.shards_are_full = self._shards_are_the_full_tensors()
        self._pack_shards()

    def _pack_shards(self) -> None:
        """Store the shards in one flat buffer laid out as this rank's all-gather slice.

        The all-gather then sends that buffer as it is: no copy-in per step. Only
        when every parameter is gathered in its own dtype from the compute device;
        with a cast (mixed precision) or CPU offload the copy-in does real work.
        """
        self._packed = None
        if self.world == 1 or self._ext is not None or not all(
            p.param_dtype == p.orig_dtype and p.padded_local.device == self.device for p in self.params
        ):
            return
        fmt = self._gather_format(self.world)
        packed = torch.zeros(fmt.slice_bytes, dtype=torch.uint8, device=self.device)
        self._packed_slots = [own_storage(slot) for slot in fmt.slots(packed)]  # pickled as torch's shards
        for p, slot in zip(self.params, self._packed_slots):
            p.adopt_padded_local(slot)
        self._packed_ptrs = [_compat.dtensor_local(p.sharded).data_ptr() for p in self.params]
        self._packed = packed

    def _shards(self, fmt: GatherFormat) -> list[torch.Tensor]:
        """Each parameter's padded shard, repacked first where the local data was rebound."""
        if self._ext is not None:  # each all-gather entry: shards and the extension hooks' inputs
            return self._ext.sources
        if self._packed is not None:
            # One pointer per parameter per all-gather: the DTensors' local data still starts at
            # its slot unless something rebound it (param.data = ..., swap_tensors): pack again.
            ptrs = [_compat.dtensor_local(p.sharded).data_ptr() for p in self.params]
            if ptrs != self._packed_ptrs:
                for p, slot, ptr, packed_ptr in zip(self.params, self._packed_slots, ptrs, self._packed_ptrs):
                    if ptr != packed_ptr:
                        p.repad_from_local()
                        p.adopt_padded_local(slot)
                self._packed_ptrs = [_compat.dtensor_local(p.sharded).data_ptr() for p in self.params]
        return [p.padded_local for p in self.params]

    # ---- what the transport asks for (comm/_transport.GatherSource) --------------------------
    def entries(self, fmt: GatherFormat) -> list[torch.Tensor]:
        """This rank's part of each all-gather entry: the shards, or after a reshard to a
        subgroup the 1/k kept (``reshard_to_subgroup``)."""
        if self.state is ShardState.PARTIAL:
            return fmt.slots(self._partial_send)
        return self._shards(fmt)

    def targets(self, fmt: GatherFormat) -> GatherTargets:
        """The unsharded buffer (allocated now) as the all-gather's targets."""
        self._alloc_unsharded()
        return self._targets(fmt)

    def laid_out(self, fmt: GatherFormat) -> tuple[torch.Tensor | None, bool]:
        """This rank's entries already laid out as ``fmt``'s slice, if they are: after a reshard
        to a subgroup the 1/k kept (only the group writes it: ``True``), else the packed shards
        (``_pack_shards``; the optimizer writes them: ``False``)."""
        if self.state is ShardState.PARTIAL:
            return self._partial_send, True
        if self._packed is not None:
            self._shards(fmt)  # packed again first where the local data was rebound
        return self._packed, False

    def _region_sizes(self) -> list[int]:
        """Bytes of each parameter's padded full tensor (each extension input's, for extension groups)."""
        if self._ext is not None and self._ext.known:  # per entry: each extension input gathered
            return self._ext.region_bytes(self.world)
        return [p.layout.padded_shape.numel() * p.param_dtype.itemsize for p in self.params]

    def _unsharded_layout(self) -> tuple[list[int], list[int], list[int]]:
        """Byte offsets (in its segment's storage) and sizes of each parameter's padded full
        tensor (16-byte aligned), and each segment's size."""
        sizes = self._region_sizes()
        starts, totals = segment_layout(sizes, self._bounds if self._ext is None else [0, len(sizes)])
        return starts, sizes, totals

    def _unsharded_bytes(self) -> int:
        gathered = self._ext.output_bytes(self.world) if self._ext is not None and self._ext.known else 0
        return sum(self._unsharded_layout()[2]) + gathered  # (extension inputs' outputs: storages of their own)

    def _alloc_unsharded(self) -> None:
        if self._buffers and self._ext is None:  # made before: only the storages come back (no tensor is made)
            return self._alloc_unsharded_buffer()
        with torch.inference_mode(False):  # the buffer and its views outlive an inference-mode first unshard
            self._alloc_unsharded_buffer()

    def _segment_bounds_for(self, early_release: bool) -> list[int]:
        """Where the unsharded buffer is cut when it is allocated: one storage per run of
        parameters a module owns where the group frees parts early (``EarlyRelease``), else one."""
        n = len(self.params)
        if self.early is None or not early_release or self._ext is not None or n < 2:
            return [0, n]
        return segment_bounds([p.locations[0][0] for p in self.params], self._region_sizes())

    def _alloc_unsharded_buffer(self) -> None:
        if not self._buffers:
            self._bounds = self._segment_bounds_for(self.policy.early_release)
            starts, sizes, totals = self._unsharded_layout()
            self._buffers = [torch.empty(total, dtype=torch.uint8, device=self.device) for total in totals]
            # Parameters are views of ``.data`` (its own version counter): refilling the
            # buffer each step must not look like an in-place change to autograd, which
            # saved these parameters in forward and reads them again in backward.
            if self._ext is not None:  # one region per all-gather entry, one segment
                buffer = self._buffers[0]
                self._regions = self._ext.bind(buffer, buffer.data, starts, sizes, self._gather_format(self.world),
                                               self._on_grad_ready)
                return
            for k, buffer in enumerate(self._buffers):
                param_base = buffer.data
                for i in range(self._bounds[k], self._bounds[k + 1]):
                    p, start, size = self.params[i], starts[i], sizes[i]
                    self._regions.append(self._typed(buffer, p, start, size))
                    p.bind_unsharded(self._typed(param_base, p, start, size), self._on_grad_ready)
            return
        for buffer in self._buffers:
            storage = buffer.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(buffer.numel())
        if self._ext is not None:
            self._ext.alloc()

    def _targets(self, fmt: GatherFormat) -> GatherTargets:
        """The unsharded buffer's regions viewed as ``fmt.world`` chunks each, where the
        all-gather puts them. Made once per world: the views outlive the buffer's frees."""
        targets = self._chunk_views.get(fmt.world)
        if targets is None:
            with torch.inference_mode(False):  # views written outside inference mode too
                chunks = [lay.chunks_view(region) for lay, region in zip(fmt.layouts, self._regions)]
            # The layout's format, not a quantized one: the chunks and the flat copy-out's split are its.
            # Without an extension the unsharded parameters (narrowed to their true rows) are all
            # that reads the buffer: the ranks holding padding only are not copied out. An
            # extension's fsdp_post_all_gather is given the padded outputs: all of them.
            layout_fmt = self._gather_format(fmt.world)
            ranks = layout_fmt.data_ranks if self._ext is None else None
            targets = self._chunk_views[fmt.world] = GatherTargets(layout_fmt, chunks, ranks)
        return targets

    @staticmethod
    def _typed(buffer: torch.Tensor, p: ShardedParam, start: int, size: int) -> torch.Tensor:
        return buffer[start:start + size].view(p.param_dtype).view(p.layout.padded_shape)

    def _free_unsharded(self) -> None:
        self._wait_peer_reads()
        for buffer in self._buffers:
            buffer.untyped_storage().resize_(0)
        if self.early is not None:
            self.early.on_reshard()
        if self._ext is not None:
            self._ext.free()

    def _wait_peer_reads(self) -> None:
        """Before any of the unsharded buffer is freed: the peers of a read all-gather are done
        reading this rank's chunks out of it."""
        gather, self._unreleased = self._unreleased, None
        if gather is not None:
            _debug.wait(gather.release(), "all_gather", self.label,
                        f"{gather.fmt.world} ranks x {gather.fmt.slice_bytes} bytes (the peers' reads)", self.root)

    def probe_transport(self) -> None:
        """Let the transport find out once what the ranks can do for each other (collective).

        Runs at the group's first all-gather, which every rank of the group issues at the
        same point: whenever the group was built (before or after the root's lazy init) and
        however it is first gathered (forward, prefetch, explicit ``unshard()``).
        """
        self._probed = True
        self.transport.probe(self.process_group)
        if self.subgroup is not None:
            self.transport.probe(self.subgroup.group)

    def refresh_transports(self) -> None:
        """Each collective's transport, as the policy picks them (``GroupPolicy.transports``)."""
        self.gather_transport, self.reduce_transport = self.policy.transports(self.transport, self.process_group)

    def set_reduce_group(self, pg: dist.ProcessGroup | None) -> None:
        """Reduce-scatter over ``pg`` (None: the shard group). Collective for a new ``pg``: the
        transport probes it now, while every member is here (``set_separate_reduce_scatter_group``)."""
        if pg is not None:
            self.transport.probe(pg)  # once per process group
        self.policy.reduce_group = pg
        self.refresh_transports()  # the reduce-scatter's buffers follow its group

    # ---- introspection (fsdp2.memory's tracker) ---------------------------------------------
    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this group holds now, by category, in order of precedence (a storage
        listed under two categories is the first's: a reduce-scatter output that the sharded
        gradients are views of is a gradient; the exchange's own chunks, sent from the
        unsharded buffer, are unsharded parameters)."""
        grads = []
        for p in self.params:
            grads += [p.sharded.grad, p.accumulated_grad, p.unsharded.grad if p.unsharded is not None else None]
        # (QuantizedComm's error-feedback residuals: kept between steps, for the next reduction.)
        comm = [self._partial_send, *self.partial_sums.values(), *(p.grad_residual for p in self.params)]
        for gather in (self._gather, self._unreleased):  # (a read all-gather's, until the peers read)
            if gather is not None:  # packed shards are sent as they are: still sharded parameters
                comm += [t for t in gather.buffers() if t is not self._packed]
        for inflight in self.reduce_queue.in_flight(self):
            comm += inflight.buffers()
        found = {
            "sharded_params": [self._packed, *(p.padded_local for p in self.params)],  # (aliases of _packed)
            "gradients": grads,
            "unsharded_params": list(self._buffers) + (self._ext.held() if self._ext is not None else []),
            "communication": comm,
        }
        return {category: [t for t in ts if isinstance(t, torch.Tensor)] for category, ts in found.items()}

    # ---- unshard / reshard --------------------------------------------------------------
    def _shards_are_the_full_tensors(self) -> bool:
        """World size 1 with nothing to cast or move: the shards already are the full tensors.

        Computed at construction and after ``invalidate()`` (``self.shards_are_full``): the
        per-step paths read the cached answer.
        """
        return (self.world == 1 and self.dp.replicate_group is None and self.subgroup is None and self._ext is None
                and all(p.tp is None and p.param_dtype == p.orig_dtype and p.padded_local.device == self.device
                        for p in self.params))

    def unshard(self, async_op: bool = False, explicit: bool = False, whole: bool = True) -> None:
        """Issue the all-gather (no-op if already gathered or in flight).

        ``explicit``: the user's ``unshard(async_op=True)``, after which any code may run
        before the wait (``send_aliases_shards``). ``whole``: segments freed early this
        backward are gathered again (forward, recomputation, the user's call); backward's own
        calls pass False, since it reads none of them again (``EarlyRelease.backward_reached``).
        """
        if whole and self.early is not None and self.early.freed:
            self.reshard()  # then gathered whole, into the same storages autograd saved views of
        if self.state in (ShardState.GATHERING, ShardState.UNSHARDED):
            return  # a prefetch already issued it: gathering twice would waste a collective
        if self.state is ShardState.SHARDED and self.shards_are_full:
            _trace.emit("unshard", self.label)
            for p in self.params:  # no collective and no copy: view the shard itself
                p.bind_unsharded(p.padded_local, self._on_grad_ready)
            self.refresh_requires_grad()
            for p in self.params:
                p.to_unsharded()
            self.state = ShardState.UNSHARDED
            return
        if not self._probed:
            self.probe_transport()
        if self._ext is not None:  # the subclasses' hooks give the inputs to gather (and their layout)
            self._ext.pre_all_gather(self.policy.mp_policy, self.device)
        partial = self.state is ShardState.PARTIAL
        if partial:
            fmt, group = self._gather_format(self.subgroup.size), self.subgroup.group
        elif self.policy.weight_block:
            fmt, group = self._quantized_format(self.world), self.process_group
        else:
            fmt, group = self._gather_format(self.world), self.process_group
        _trace.emit("unshard", self.label)
        with _trace.profiled("fsdp2::all_gather", self.label), _trace.issuing("all_gather", self.label):
            header = _checks.before_all_gather(self, fmt, group)
            self._header_pg = group if header is not None else None  # the ranks' headers are compared over it
            self._gather = self.gather_transport.start_all_gather(self, fmt, group, header, explicit)
        self._partial_send = None
        self.state = ShardState.GATHERING
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self, whole: bool = True) -> bool:
        """Finish the all-gather and point the modules at the unsharded parameters (False: gathered already)."""
        if whole and self.early is not None and self.early.freed:
            self.reshard()
        if self.state in (ShardState.SHARDED, ShardState.PARTIAL):
            self.unshard(async_op=True)
        if self.state is ShardState.UNSHARDED:
            return False
        gather = self._gather
        with _trace.profiled("fsdp2::all_gather_wait", self.label):
            pg, self._header_pg = self._header_pg, None  # checked once, even if the check raises
            _checks.wait_all_gather(self, gather, pg)  # errors name the group; compares the ranks' headers
            self._alloc_unsharded()
            gather.transport.finish_all_gather(gather, self._targets(gather.fmt))
            if self._ext is not None:  # rebuild the subclasses' unsharded tensors from what arrived
                self._ext.post_all_gather(self._on_grad_ready)
        if gather.release() is not None:
            self._unreleased = gather
        self._gather = None  # only now: if the copy raised, reset() still finds the collective
        if register_forms(self.params, unsharded=True):
            self.refresh_requires_grad()  # a flag set on the sharded form since reaches autograd's
        self.state = ShardState.UNSHARDED
        return True

    def reshard(self) -> None:
        """Back to shards only; frees the unsharded buffer's storage."""
        if self.state is ShardState.GATHERING:
            self.wait_for_unshard()  # its buffers are in use by the collective
        if self.state is ShardState.SHARDED:
            return
        _trace.emit("reshard", self.label)
        if register_forms(self.params, unsharded=False):
            self.refresh_requires_grad()  # a flag set on the unsharded form shows on the sharded one
        self._free_unsharded()
        self._partial_send = None
        self.state = ShardState.SHARDED

    def reshard_to_subgroup(self) -> None:
        """UNSHARDED -> PARTIAL: keep this rank's 1/k of the full parameters, free the rest."""
        if self.state is not ShardState.UNSHARDED:
            return
        fmt = self._gather_format(self.subgroup.size)
        send = torch.empty(fmt.slice_bytes, dtype=torch.uint8, device=self.device)
        with torch.no_grad():
            for i, region in enumerate(self._regions):
                fmt.slot(send, i).copy_(fmt.layouts[i].chunks_view(region)[self.subgroup.rank])
        _trace.emit("reshard_partial", self.label)
        for p in self.params:
            p.to_sharded()
        self._free_unsharded()
        self._partial_send = send
        self.state = ShardState.PARTIAL

    def reshard_after_forward_step(self) -> None:
        policy = self.policy.reshard_after_forward
        if policy is True:
            self.reshard()
        elif policy is not False and policy is not None:
            self.reshard_to_subgroup()

    # ---- trainable parameters -----------------------------------------------------------
    def _count_trainable(self) -> None:
        self._num_trainable = sum(p.requires_grad for p in self.params)
        self.has_frozen = self._num_trainable < len(self.params)

    def refresh_requires_grad(self) -> None:
        """Follow ``requires_grad`` changes on either form of the parameters since the last look.

        Called at each pre-forward and pre-backward and wherever the modules swap forms (unshard,
        reshard): one flag comparison per form; counts are rebuilt only when one changed. Frozen
        parameters get no gradient, no reduce-scatter, and so no ``.grad`` for the optimizer
        to step with. A change after a forward is safe for its backward: that forward either
        routed its inputs (``_InputsGradReady``) or counts as unhooked (``unhooked_forward``), so a
        parameter frozen since is never freed before backward is done with it.
        """
        if requires_grad_changed(self.params) and any([p.sync_requires_grad() for p in self.params]):  # a list: all
            self._count_trainable()

    @property
    def waits_for_inputs(self) -> bool:
        """Whether this group's reduction waits for the gradients of its module's inputs.

        Frozen parameters take no gradient, so no hook says when backward stops using them
        (a frozen LoRA base weight still computes its input's gradient after the adapters'
        gradients are in): the module's inputs' gradients come after every such use.
        ``set_reduce_scatter_unused_params`` groups reduce there too (see ``_state.py``).
        A group of several modules waits for them as well: a forward may run some of its
        modules only (a chunked loss runs the head of ``[norm, head]`` on its own), and the
        others' parameters then get no gradient that would say backward is done.
        """
        return self.policy.reduce_unused or self.has_frozen or self.several_modules

    def set_early_release(self, enabled: bool) -> None:
        """``FSDPModule.set_early_release``: the buffer is cut into segments when first allocated."""
        if enabled and self.early is not None and self._buffers and self._bounds != self._segment_bounds_for(True):
            raise RuntimeError(
                f"set_early_release(True) on {self.label} after its unsharded buffer was allocated in one "
                "piece (by a forward or unshard()); call it before the module's first forward"
            )
        self.policy.early_release = enabled

    # ---- what EarlyRelease asks of its group (_release.ReleaseHost) --------------------------
    def grads_final(self) -> set[int]:
        """Ids of the parameters whose gradient autograd accumulated this backward."""
        return self._grads_ready

    def reduces_as_final(self) -> bool:
        """Whether the gradients are reduced as soon as they are final: sync on, not at the
        module's inputs, and (HSDP) all-reduced now rather than kept as partial sums."""
        policy = self.policy
        return policy.requires_gradient_sync and not self.waits_for_inputs and not (
            self.dp.replicate_group is not None and (not policy.requires_all_reduce or self.partial_sums))

    def reduce_gradients(self, params: list[ShardedParam], label: str) -> None:
        """Reduce ``params``' gradients now (part of the group's), as the group's reduction does."""
        _reduction.reduce_gradients(self, params, label)

    def segments(self) -> list[list[ShardedParam]]:
        """The parameters of each segment of the unsharded buffer, in order."""
        bounds = self._bounds
        return [self.params[lo:hi] for lo, hi in zip(bounds, bounds[1:])]

    def segment_buffer(self, k: int) -> torch.Tensor:
        return self._buffers[k]

    def free_segments(self, segments: list[int]) -> None:
        """Free some segments of the unsharded buffer (the rest stays): their parameters are
        the shards again on the modules. One ``release`` event for them all."""
        self._wait_peer_reads()
        _trace.emit("release", self.label)
        for k in segments:
            for p in self.params[self._bounds[k]:self._bounds[k + 1]]:
                p.to_sharded()
            self._buffers[k].untyped_storage().resize_(0)

    # ---- backward -----------------------------------------------------------------------
    def pre_backward(self) -> None:
        self.backward_started = True
        if not (self.policy.unshard_in_backward and self.wait_for_unshard(whole=False)):
            self.refresh_requires_grad()  # frozen or unfrozen since forward: honoured by this backward

    def _on_grad_ready(self, param: ShardedParam) -> None:
        if not param.unsharded.requires_grad:
            return  # frozen since its forward: autograd runs the hook but accumulates nothing
        if self.post_backward_done and self.policy.reduce_unused:  # reduced at the end of the module's backward
            raise RuntimeError(
                f"fsdp2: the gradient of {self._name_of(param)} arrived after {self.label} had reduced its "
                "gradients at the end of its module's backward (set_reduce_scatter_unused_params): "
                "the parameter is used outside that module's forward; wrap the module that uses it "
                "with fully_shard instead, or turn set_reduce_scatter_unused_params off"
            )
        key = id(param)
        if key in self._grads_ready and self.early is not None:  # accumulated twice in one backward
            self.early.gradient_repeated()
        self._grads_ready.add(key)
        if self.post_backward_done or len(self._grads_ready) < self._num_trainable:
            return
        if not self.has_frozen or self._inputs_done():
            self.post_backward()

    def _inputs_done(self) -> bool:
        """Backward has computed the gradients of every (still live) forward's inputs."""
        return not self.inputs_pending and not self.unhooked_forward

    def inputs_grad_ready(self, token: Any) -> None:
        """The gradients of one forward's inputs are computed: that forward's backward is over."""
        self.inputs_pending.discard(token)
        if not self.backward_started or self.post_backward_done or not self._inputs_done():
            return
        # reduce_unused: parameters that got no gradient on this rank will not get one now:
        # reduce (zeros for them), at the same point of backward on every rank. Several
        # modules: those a forward did not run have no gradient coming.
        if self.policy.reduce_unused or self.several_modules or len(self._grads_ready) == self._num_trainable:
            self.post_backward()

    def post_backward(self) -> None:
        """Reduce-scatter the group's gradients (or keep them, when not syncing); reshard.

        The unsharded parameters are freed before the reduce-scatter's buffers are allocated
        (``_reduction.reduce_gradients``): the gradients, not the parameters, are what it reads.
        """
        self.post_backward_done = True
        if self.policy.requires_gradient_sync:
            _reduction.reduce_gradients(self)
        else:
            for p in self.params:
                if p.requires_grad:
                    p.stash_unsynced_grad()
        if self.policy.reshard_after_backward:
            self.reshard()

    def _name_of(self, p: ShardedParam) -> str:
        """``p``'s FQN under the root (as the rank checks name it), once lazy init knows it."""
        diag = self.root.diag if self.root is not None else None
        return diag.param_names.get(id(p), p.fqn) if diag is not None else p.fqn

    def end_backward(self, forwards_done: bool = True) -> None:
        """Called by the root after backward: finish what per-tensor hooks did not.

        ``forwards_done=False``: the backward of a standalone call (``RootContext.local_backward``);
        the root's forward still waits for its own, so what this group knows of it stays.
        """
        if self.backward_started and not self.post_backward_done:
            self.post_backward()
        elif self.policy.reshard_after_backward:
            self.reshard()  # e.g. prefetched but never reached, or kept since forward
        self.backward_started = False
        self.post_backward_done = False
        self._grads_ready.clear()
        if self.early is not None:
            self.early.end_backward()
        if forwards_done:
            self.unhooked_forward = False

    def reset(self) -> None:
        """Return to a clean sharded state after an exception mid-iteration."""
        if self._gather is not None:
            self._gather.done.wait()
            if self._gather.release() is not None:
                self._unreleased = self._gather
            self._gather = None
            self._header_pg = None
            self.state = ShardState.SHARDED  # modules still hold the shards while gathering
            self._free_unsharded()  # the exchange gathers into it
        self.reshard()
        for p in self.params:
            if p.unsharded is not None:
                p.unsharded.grad = None
            p.accumulated_grad = None
        self.partial_sums.clear()
        self.inputs_pending.clear()
        self.backward_started = False
        self.post_backward_done = False
        self._grads_ready.clear()
        if self.early is not None:
            self.early.reset()
        self.unhooked_forward = False
