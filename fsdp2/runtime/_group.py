"""A group of parameters gathered, freed and reduced together, and its state machine.

One ``fully_shard`` call makes one group per data-parallel mesh its parameters are
sharded on. The group owns a persistent *unsharded buffer* (``_buffers.py``: every
unsharded parameter is a view of it) whose storage is allocated on unshard and released
on reshard; this file holds when that happens: unshard, reshard, and backward's reduction.

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

from .._common import ShardState
from ..diagnostics import _trace
from . import _checks
from ..comm._collectives import AllGatherInFlight, GatherTargets
from ..comm._transport import Transport, choose_transport
from . import _extension
from ._buffers import GroupBuffers
from ._extension import GroupExtension
from .._format import GatherFormat
from ._mesh import DataParallelMesh, SubGroup
from ._param import ShardedParam, raise_if_on_meta, register_forms, requires_grad_changed
from ._policy import GroupPolicy
from ._release import EarlyRelease
from ._reduce_queue import ReduceQueue
from . import _reduction


__all__ = ["ShardState", "ParamGroup", "ReduceQueue", "SubGroup"]


class ParamGroup(GroupBuffers):
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
        self._packed_header: torch.Tensor | None = None  # its header's 16 bytes (see header_room)
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
        # A forward of this iteration did not route its inputs through InputsGradReady (none
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
        """The memory planner's run (``plan/_simulate.py``): every buffer of this group on meta."""
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
        routed its inputs (``InputsGradReady``) or counts as unhooked (``unhooked_forward``), so a
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
