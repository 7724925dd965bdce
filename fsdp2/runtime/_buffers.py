"""A parameter group's memory: the all-gather's layouts and the unsharded buffer.

``GroupBuffers`` is the half of ``ParamGroup`` (``_group.py``) that owns bytes: the
all-gather's send layout (``GatherFormat``, the shards packed back to back so the send needs
no copy-in), the persistent unsharded buffer every unsharded parameter views (its storage
allocated on unshard and released on reshard, so the parameter objects autograd refers to
never change), its segments (freed one at a time by ``EarlyRelease``), and what the memory
tracker counts. ``ParamGroup`` holds the state machine that decides when each runs.
"""

from __future__ import annotations

import contextlib

import torch

from .. import _compat
from .._common import ShardState
from ..comm._collectives import GatherTargets
from ..diagnostics import _debug, _trace
from .._format import HEADER, GatherFormat, segment_layout
from ._param import ShardedParam, own_storage
from ._release import segment_bounds

__all__ = ["GroupBuffers"]


class GroupBuffers:
    """The buffers of a ``ParamGroup`` (a mixin: the attributes are set by ``ParamGroup.__init__``)."""

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

    def _pack_shards(self) -> None:
        """Store the shards in one flat buffer laid out as this rank's all-gather slice.

        The all-gather then sends that buffer as it is: no copy-in per step. Only
        when every parameter is gathered in its own dtype from the compute device;
        with a cast (mixed precision) or CPU offload the copy-in does real work.
        """
        self._packed = self._packed_header = None
        if self.world == 1 or self._ext is not None or not all(
            p.param_dtype == p.orig_dtype and p.padded_local.device == self.device for p in self.params
        ):
            return
        fmt = self._gather_format(self.world)
        with self._unseen_by_modes():
            packed = torch.zeros(fmt.slice_bytes, dtype=torch.uint8, device=self.device)
            self._packed_slots = [own_storage(slot) for slot in fmt.slots(packed)]  # pickled as torch's shards
            self._packed_header = own_storage(packed[:HEADER])
        for p, slot in zip(self.params, self._packed_slots):
            p.adopt_padded_local(slot)
        self._packed_ptrs = [_compat.dtensor_local(p.sharded).data_ptr() for p in self.params]
        self._packed = packed

    def _unseen_by_modes(self) -> contextlib.AbstractContextManager:
        """Where the packed buffer and its slots' aliases are made. Where the shards are plain
        tensors in real memory (each alias then a storage of its own), outside this thread's
        dispatch modes: a mode that registers each op's output storage (torch's ``MemTracker``
        around ``fully_shard``) sees the shards' aliases as the copies into them write them, and
        not also the buffer under them (each byte once). Elsewhere (the planner's meta run, a
        fake mode's tensors) the modes see it all, as they see every shard."""
        if self.device.type in ("cpu", "cuda") and all(type(p.padded_local) is torch.Tensor for p in self.params):
            return _compat.outside_dispatch_modes()
        return contextlib.nullcontext()

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

    def header_room(self, send: torch.Tensor) -> torch.Tensor:
        """The first 16 bytes of ``send``, where the transport stamps the all-gather's header
        under a dispatch mode: for the packed shards, their header's own storage
        (``own_storage``), so a mode that registers each op's output storage (torch's
        ``MemTracker``) sees those 16 bytes, not the whole packed buffer beside the shards'
        aliases (each byte counted twice); for any other send buffer, a view of it."""
        if send is self._packed and self._packed_header is not None:
            return self._packed_header
        return send[:HEADER]

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
            # (The header's and each shard's storage: aliases of _packed.)
            "sharded_params": [self._packed, self._packed_header, *(p.padded_local for p in self.params)],
            "gradients": grads,
            "unsharded_params": list(self._buffers) + (self._ext.held() if self._ext is not None else []),
            "communication": comm,
        }
        return {category: [t for t in ts if isinstance(t, torch.Tensor)] for category, ts in found.items()}

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
