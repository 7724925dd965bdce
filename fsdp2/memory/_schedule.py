"""fsdp2's buffer schedule on one rank, replayed by the memory planner (``_planner.py``).

``_Group``: one group's bytes from its parameters' shapes. ``_Schedule``: when fsdp2
allocates and frees each group's unsharded buffer, all-gather and reduce-scatter buffers
and gradients, driven by hooks on the planner's fake model. It mirrors ``runtime/`` and
``comm/``: change it with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from torch.distributed.tensor import DTensor

from .._api import QuantizedComm
from ..comm._transport import BufferNeeds, GroupBytes, Transport, choose_transport
from .._format import HEADER, Chunking, aligned, chunk_rows

from ._quantized import QuantizedGroup

if TYPE_CHECKING:
    from ._planner import _Timeline

@dataclass
class _Group(GroupBytes):
    """One fsdp2 group's bytes on a rank: what its transport needs (``GroupBytes``), and more."""

    sharded: int = 0  # original dtype
    same_grad_dtype: bool = True  # reduce dtype == the parameters' dtype (sharded grads view the output)
    # Per tensor, for the quantized collectives (``_quantized.py``): how it is cut, its gathered
    # dtype, its shard's dtype, whether it is trained (has an error-feedback residual).
    layouts: list[Chunking] = field(default_factory=list)
    gather_dtypes: list[torch.dtype] = field(default_factory=list)
    shard_dtypes: list[torch.dtype] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)

    def __add__(self, other: _Group) -> _Group:
        return _Group(self.unsharded + other.unsharded, self.slice + other.slice, self.reduce + other.reduce,
                      self.packed and other.packed, self.entries + other.entries, self.sharded + other.sharded,
                      self.same_grad_dtype and other.same_grad_dtype, self.layouts + other.layouts,
                      self.gather_dtypes + other.gather_dtypes, self.shard_dtypes + other.shard_dtypes,
                      self.trained + other.trained)

    def transport(self, gloo: bool) -> Transport:
        """The transport fsdp2 picks for this group (``comm/_transport.choose_transport``)."""
        return choose_transport(torch.device("cpu" if gloo else "meta"), self.unsharded)

    def shard_storage(self, shard: int) -> int:
        """Bytes of the shards' storage: packed into one send slice (header included) when sharded."""
        return HEADER + self.slice if self.packed and shard > 1 and self.entries else self.sharded


def _add_param(group: _Group, p: torch.Tensor, shard: int, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype) -> None:
    # A tensor-parallel parameter: fsdp2 shards this rank's TP shard.
    shape = list(p.to_local().shape if isinstance(p, DTensor) else p.shape)
    rows = shape[0] if shape else 1
    rest = math.prod(shape[1:]) if len(shape) > 1 else 1
    chunk = chunk_rows(rows, shard)
    pdtype = param_dtype if p.dtype.is_floating_point else p.dtype
    group.sharded += chunk * rest * p.dtype.itemsize
    group.unsharded += aligned(chunk * shard * rest * pdtype.itemsize)
    group.slice += aligned(chunk * rest * pdtype.itemsize)
    reduced = chunk * shard * rest * (reduce_dtype if p.dtype.is_floating_point else p.dtype).itemsize
    group.reduce += reduced
    # fp16 reduces pre-divide their copy (fsdp2/comm/_collectives.py::reduce_op).
    predivide = p.dtype.is_floating_point and reduce_dtype not in (torch.float32, torch.bfloat16)
    copied = pdtype != reduce_dtype and p.dtype.is_floating_point or chunk * shard != rows or predivide
    group.entries.append((chunk * rest * pdtype.itemsize, reduced, copied))
    group.same_grad_dtype &= not p.dtype.is_floating_point or reduce_dtype == p.dtype
    group.packed &= pdtype == p.dtype
    group.layouts.append(Chunking(torch.Size(shape or [1]), 0, shard, chunk))
    group.gather_dtypes.append(pdtype)
    group.shard_dtypes.append(p.dtype)
    group.trained.append(p.dtype.is_floating_point and p.requires_grad)


class _Schedule:
    """fsdp2's buffer lifetimes on one rank, replayed from hooks on the fake model.

    Mirrors the steady state of ``_state.py`` / ``_group.py`` / ``_release.py`` (second and
    later steps): forward gathers a group, prefetches the next one in forward order and
    reshards after forward per policy (the root keeps its parameters unless ``root_reshard``;
    with ``early_release`` it frees the segments forward saved nothing of); backward
    gathers a group again if needed, prefetches the one before it (with ``early_release``,
    reduces the root's final gradients at each block's pre-backward and frees the root's
    segments whose gradients are all final), and once all of its
    gradients landed reshards, finishes the oldest reduce-scatters in flight until there is
    room for one more (the transport's ``reduce_scatters_in_flight``: one, two for gloo exchanges)
    and reduce-scatters; the output of a finished one becomes the sharded gradients. Change this class
    with those files and ``_collectives.py`` / ``_exchange.py``. The two transports:

    * NCCL (flat): an all-gather fills a send slice (no copy when the shards are packed)
      and a rank-major output, copied into the unsharded buffer at the wait; a
      reduce-scatter copies the full gradients into a send buffer (reduce dtype), frees
      them, and reduces into a 1/shard output.
    * gloo (exchange, groups of ``EXCHANGE_MIN_BYTES`` and more): the unsharded buffer is
      allocated when the all-gather is issued and received into directly (only the
      headers and the packed small chunks are extra); a reduce-scatter sends from the
      gradients themselves (copies only to cast or pad, which lets the gradients go),
      receives one 1/shard row per peer and sums into the first. Smaller gloo groups
      take the flat path, whose reduce-scatter keeps a full-size copy of its input.
      With ``reads`` (one host) nothing is packed; small descriptors and acknowledgements
      replace the data messages.

    ``QuantizedComm`` groups run fsdp2's quantization on fake tensors (``_quantized.py``) in
    their transport's order: on the exchange the quantized slices land in a rank-major buffer
    allocated at issue (the unsharded buffer only at the wait, dequantized into), kept until
    reshard where the peers read it; the gradients' packed rows are sent and received beside
    the exchange's own headers, packed chunks or descriptors (``quantized_buffer_needs``).
    """

    def __init__(self, line: _Timeline, sizes: dict[str, _Group], order: list[str], *, shard: int,
                 alias: bool, reshard: bool, root_reshard: bool, grad_accum: int, gloo: bool,
                 reads: bool, root_params: dict[str, _Group], root_segments: list[list[str]],
                 early_release: bool = False, policy: QuantizedComm | None = None,
                 reduce_dtype: torch.dtype = torch.float32, replicas: int = 1) -> None:
        self.line, self.sizes, self.order = line, sizes, order
        self.shard, self.alias, self.grad_accum = shard, alias, grad_accum
        # QuantizedComm (more than one rank): its collectives run on fake tensors (``_quantized.py``)
        # in the order of the group's transport; ``held`` keeps each group's quantized all-gather.
        # (One shard rank: nothing gathered or reduce-scattered, but HSDP's all-reduce may be quantized.)
        self.policy = policy if policy is not None and not alias and (
            shard > 1 or replicas > 1 and policy.replicate_grad_block) else None
        self._reduce_dtype, self._replicas = reduce_dtype, replicas
        backend = "gloo" if gloo else "nccl"
        self._needs_args = (shard, backend, reads)
        # What each group's transports hold for their collectives (reads: gloo exchanges read the
        # peers' memory, one host, instead of messages). As ``runtime/_group.refresh_transports``:
        # quantized gradients are reduced by the group's transport, quantizing.
        self.transports = {name: g.transport(gloo) for name, g in sizes.items()}
        self.quantized = {name: self._quantized(g, name) for name, g in sizes.items()}
        self.held: dict[str, tuple[torch.Tensor, ...]] = {}
        self.kept: list[torch.Tensor] = []  # reduce-scatter outputs the sharded gradients view
        reduces = {name: t.quantizing_gradients(self.policy.grad_block, self.policy.grad_bits)
                   if self.quantized[name] and self.quantized[name].reduces else t
                   for name, t in self.transports.items()}
        # A quantized all-gather receives into its quantized buffer, never the unsharded one.
        self.in_place = {name: t.gathers_in_place and not (self.quantized[name] and self.quantized[name].gathers)
                         for name, t in self.transports.items()}
        self.limit = {name: t.reduce_scatters_in_flight(shard) for name, t in reduces.items()}
        self.needs: dict[str, BufferNeeds] = {
            name: t.buffer_needs(sizes[name], *self._needs_args) for name, t in reduces.items()}
        self.gather_needs: dict[str, BufferNeeds] = {
            name: self.quantized[name].needs if self.quantized[name] and self.quantized[name].gathers
            else t.buffer_needs(sizes[name], *self._needs_args) for name, t in self.transports.items()}
        self._root_transport = reduces["root"]
        # The root's parameters (by name) and, with early_release, its segments (EarlyRelease):
        # after forward the segments forward saved nothing of are freed (release_unsaved); in
        # backward, at each block's pre-backward, the root's final gradients are reduced and
        # the segments all of whose gradients are final freed (release_finished). No segments
        # at world size 1 without a cast. By default neither: the root as torch's FSDP2.
        self.root_params, self.early_release = root_params, early_release
        self.segments = root_segments if early_release and len(root_segments) > 1 and not alias else []
        self.released: set[int] = set()
        self.reduced_params: set[str] = set()
        self.unsharded_now = {name: 0 for name in order}
        self.gather_held = {name: False for name in order}
        self.reshard_after_forward = {name: reshard for name in order}
        self.reshard_after_forward["root"] = root_reshard
        self.state = {name: "sharded" for name in order}
        # Reduce-scatters in flight: group, how to drop the gradients they hold, and (a part of the
        # root's gradients, release_finished) what they reduce.
        self.pending: list[tuple[str, Callable[[], None] | None, _Group | None]] = []
        self.reduced: set[str] = set()

    def _quantized(self, group: _Group, name: str) -> QuantizedGroup | None:
        """``group`` (group ``name``'s parameters, or some of the root's) quantized, on ``name``'s transport."""
        if self.policy is None:
            return None
        return QuantizedGroup(self.line, group, self.policy, self.shard, self._reduce_dtype, self._replicas,
                              self.transports[name], *self._needs_args[1:])

    def _gather_bytes(self, name: str) -> int:
        """Communication buffers of a group's all-gather in flight."""
        return 0 if self.alias else self.gather_needs[name].gather

    def _released_at_reshard(self, name: str) -> bool:
        """Read all-gathers keep their buffers until the unsharded buffer is freed (peers read it)."""
        return not self.alias and self.gather_needs[name].gather_until_reshard

    def _unsharded_bytes(self, name: str) -> int:
        return 0 if self.alias else self.sizes[name].unsharded

    def unshard(self, name: str) -> None:
        if self.state[name] == "sharded":
            self.state[name] = "gathering"
            q = self.quantized[name]
            if q is not None and q.gathers:
                self.held[name] = q.start_all_gather()
            self.line.add_bytes("communication", self._gather_bytes(name))
            if self.in_place[name]:
                self._hold_unsharded(name)

    def _hold_unsharded(self, name: str) -> None:
        self.unsharded_now[name] = self._unsharded_bytes(name)
        self.line.add_bytes("unsharded_params", self.unsharded_now[name])

    def wait(self, name: str) -> None:
        self.unshard(name)
        if self.state[name] == "gathering":
            self.state[name] = "unsharded"
            if not self.in_place[name]:
                self._hold_unsharded(name)
            if name in self.held:  # quantized: dequantized into the unsharded buffer
                self.quantized[name].finish_all_gather(self.held[name])
                self.line.check_peak()
            if self._released_at_reshard(name):
                self.gather_held[name] = True
            else:
                self.line.add_bytes("communication", -self._gather_bytes(name))
                self.held.pop(name, None)

    def _drop_gather(self, name: str) -> None:
        """A read all-gather's buffers go when any of the unsharded buffer is first freed."""
        if self.gather_held[name]:
            self.gather_held[name] = False
            self.line.add_bytes("communication", -self._gather_bytes(name))
            self.held.pop(name, None)

    def reshard(self, name: str) -> None:
        if self.state[name] == "gathering":  # its buffers are in use by the collective
            self.wait(name)
        if self.state[name] == "unsharded":
            self.state[name] = "sharded"
            self._drop_gather(name)
            self.line.add_bytes("unsharded_params", -self.unsharded_now[name])
            self.unsharded_now[name] = 0
            if name == "root":
                self.released.clear()

    def _release_segment(self, k: int) -> None:
        self._drop_gather("root")
        freed = sum(self.root_params[n].unsharded for n in self.segments[k])
        self.unsharded_now["root"] -= freed
        self.line.add_bytes("unsharded_params", -freed)
        self.released.add(k)

    def release_unsaved(self, saved: set[str]) -> None:
        """After the root's forward: free the segments none of whose parameters forward saved."""
        if not self.segments or self.state["root"] != "unsharded":
            return
        for k, names in enumerate(self.segments):
            if k not in self.released and not saved.intersection(names):
                self._release_segment(k)

    def release_finished(self, ready: list[str], drop_grads: Callable[[list[str]], None]) -> None:
        """A block's pre-backward: reduce the root's final gradients (``ready``, by name), freeing
        the segments whose gradients are all final first (with ``early_release``)."""
        if not self.early_release or self.state["root"] != "unsharded" or "root" in self.reduced:
            return
        finished = [n for n in ready if n not in self.reduced_params]
        if not finished:
            return
        done = set(ready)
        for k, names in enumerate(self.segments):
            if k not in self.released and done.issuperset(names):
                self._release_segment(k)
        self.reduced_params.update(finished)
        self._reduce("root", lambda: drop_grads(finished), self.part(finished))

    def part(self, names: list[str]) -> _Group:
        """The bytes of some of the root's parameters, as a group of their own."""
        return sum((self.root_params[n] for n in names[1:]), self.root_params[names[0]])

    def _needs(self, name: str, part: _Group | None) -> BufferNeeds:
        return self.needs[name] if part is None else self._root_transport.buffer_needs(part, *self._needs_args)

    def pre_forward(self, name: str) -> None:
        self.line.where = f"forward, {name}"
        self.unshard(name)
        index = self.order.index(name)
        if index + 1 < len(self.order):
            self.unshard(self.order[index + 1])
        self.wait(name)

    def post_forward(self, name: str) -> None:
        if self.reshard_after_forward[name]:
            self.reshard(name)

    def pre_backward(self, name: str, after_wait: Callable[[], None] | None = None) -> None:
        """Gather ``name`` (wait), run ``after_wait`` (the root's release_finished), prefetch."""
        self.line.where = f"backward, {name}"
        self.wait(name)
        if after_wait is not None:
            after_wait()
        index = self.order.index(name)
        target = self.order[-1] if name == "root" else self.order[index - 1] if index > 0 else None
        if target is not None and target != name and target not in self.reduced:
            self.unshard(target)

    def _rs_bytes(self, name: str, part: _Group | None = None) -> tuple[int, int]:
        """(input, output) buffers of a group's reduce-scatter in flight (the transport's
        ``buffer_needs``); on one rank with nothing to cast, the gradients as they are."""
        if self.alias:
            return self.sizes[name].reduce, 0
        needs = self._needs(name, part)
        return needs.reduce_sent, needs.reduce_received

    def post_backward(self, name: str, drop_grads: Callable[[], None]) -> None:
        """As ``runtime/_reduction.reduce_gradients``: reshard, then reduce what is left (the root's
        gradients not reduced by ``release_finished``)."""
        self.reduced.add(name)
        self.reshard(name)
        part = None
        if name == "root" and self.reduced_params:
            rest = [n for n in self.root_params if n not in self.reduced_params]
            if not rest:
                return
            part = self.part(rest)
        self._reduce(name, drop_grads, part)

    def _reduce(self, name: str, drop_grads: Callable[[], None], part: _Group | None) -> None:
        """Finish the oldest reduce-scatters until there is room for one more, then allocate the
        send buffer, copy the gradients in and (flat) free them before the output exists."""
        sent, received = self._rs_bytes(name, part)
        if self.alias:  # one rank: the full gradients are the sharded ones, kept as they are
            return
        while len(self.pending) >= self.limit[name]:
            self.finish(*self.pending.pop(0))
        q = self.quantized[name]
        if q is not None and q.reduces:
            if part is not None:
                q = self._quantized(part, name)
            self.pending.append((name, None, part, (q, q.start_reduce_scatter(drop_grads))))
            self.line.check_peak()
            return
        # The exchange sends from the gradients themselves unless every one was copied.
        needs = self._needs(name, part)
        held, copies_in = needs.reduce_holds_gradients, needs.reduce_copies_in
        self.line.add_bytes("communication", sent)
        if copies_in:
            drop_grads()  # copied into the send buffer: freed before the output is allocated
        self.line.add_bytes("communication", received)
        self.pending.append((name, drop_grads if held else None, part))
        if not copies_in and not held:
            drop_grads()  # only now: the reducing function holds them until it returns

    def finish(self, name: str, drop_grads: Callable[[], None] | None, part: _Group | None = None,
               quantized: tuple[QuantizedGroup, tuple[torch.Tensor, ...]] | None = None) -> None:
        """The reduce-scatter's output becomes the sharded gradients (a view of it).

        gloo's flat reduce-scatter holds a full-size copy of its input, which ops (and so the
        tracker) see once it is waited on, until the finished collective is dropped.
        """
        if quantized is not None:
            self._finish_quantized(name, part, *quantized)
            return
        if self.quantized[name] is not None:  # HSDP's all-reduce quantized, the reduce-scatter not
            (self.quantized[name] if part is None else self._quantized(part, name)).all_reduce(None)
        sent, received = self._rs_bytes(name, part)
        g = self.sizes[name] if part is None else part
        out = g.reduce // self.shard if self.shard > 1 else 0
        gloo_copy = 0 if self.alias else self._needs(name, part).reduce_input_copy
        self.line.add_bytes("communication", gloo_copy)
        if self.grad_accum > 1:  # added into the sharded gradients of earlier micro-batches
            self.line.add_bytes("communication", -out)
        elif g.same_grad_dtype and out:  # the gradients are views of the output: it changes category
            self.line.extra["communication"] -= out
            self.line.extra["gradients"] += out
        else:  # a copy in the parameters' dtype (or, on one rank, the send buffer's)
            self.line.add_bytes("gradients", g.sharded)
            self.line.add_bytes("communication", -out)
        self.line.add_bytes("communication", -(sent + received - out) - gloo_copy)
        if drop_grads is not None:
            drop_grads()

    def _finish_quantized(self, name: str, part: _Group | None, q: QuantizedGroup,
                          held: tuple[torch.Tensor, ...]) -> None:
        """A quantized reduce-scatter's output, summed from what arrived, becomes the sharded
        gradients (a view of it where the dtypes agree, else a copy), or is added into the
        earlier micro-batches' (``grad_accum``)."""
        g = self.sizes[name] if part is None else part
        out = q.finish_reduce_scatter(held)
        q.all_reduce(out)
        if self.grad_accum == 1 and g.same_grad_dtype:
            self.line.label(out, "gradients")
            self.kept.append(out)
        elif self.grad_accum == 1:
            self.line.add_bytes("gradients", g.sharded)
        del out, held
        self.line.add_bytes("communication", -q.reduce_bytes)

    def end_backward(self) -> None:
        self.line.where = "end of backward"
        for name in reversed(self.order):
            self.reshard(name)
        while self.pending:
            self.finish(*self.pending.pop(0))
