"""Consistency checks between ranks: they turn silent mistakes and hangs into clear errors.

* **Rank agreement** (once, at the root's lazy init): every rank that shares the
  model must have built the same groups, parameters (FQN, global shape, dtype,
  ``requires_grad``, shard dim) and meshes. Checked with an all-gather of JSON text
  (``_wire``) over each axis of the model's own meshes (a hash first, the details only on
  a mismatch); agreement along every axis of a connected mesh is agreement
  across it. Raises ``ValueError`` on every rank, naming the first difference.
* **All-gather headers** (every all-gather): each rank's slice starts with 16
  bytes saying which group it gathers, in which iteration and phase. If two
  ranks' all-gathers matched up although they gather different groups, or one
  in forward and one in backward (a rank skipped a forward, or ran one more),
  every rank raises ``RuntimeError``
  instead of silently computing with the wrong parameters. On CPU always; on
  CUDA only in debug mode (reading the headers synchronises the device).
* **Reduce-scatter headers** (CPU exchanges): 16 bytes saying which group and
  which of its parameters the rank reduces travel ahead of the gradients. Ranks
  that disagree (a branch that ran on some ranks only) raise ``RuntimeError``
  naming the group, instead of summing mismatched chunks.
* **Finite gradients** (opt-in, ``FSDPModule.set_check_finite_gradients``):
  each reduced gradient shard is checked; at the end of backward one small
  all-reduce per mesh axis agrees on the first non-finite parameter and every
  rank raises ``FloatingPointError``.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import struct
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from .. import _compat, _wire
from .._compat import root_mesh
from .._format import ALL_GATHER_MAGIC, REDUCE_MAGIC
from ..diagnostics import _debug
from ._shapes import GroupShape, RootShape, StateShape

if TYPE_CHECKING:
    from .._format import GatherFormat
    from ..comm._collectives import AllGatherInFlight
    from ._param import ShardedParam

__all__ = [
    "Diagnostics", "check_rank_agreement", "before_all_gather", "wait_all_gather", "reduce_header",
    "record_nonfinite", "raise_if_nonfinite",
]

class Diagnostics:
    """What the checks need to know about one root's model, built at lazy init.

    Args:
        states: the root's ``ModuleState`` objects in registration order.
        names: module -> its FQN under the root.
    """

    def __init__(self, states: Sequence[StateShape], names: dict[Any, str]) -> None:
        self.groups = [g for s in states for g in s.groups]
        self.index = {id(g): i for i, g in enumerate(self.groups)}
        self.param_names = {
            id(p): _join(names.get(p.locations[0][0], "?"), p.locations[0][1])
            for g in self.groups for p in g.params
        }
        self.process_groups = _mesh_groups(self.groups)
        self.nonfinite: list[tuple[str, torch.Tensor]] = []  # (FQN, count), in reduction order

    def describe(self) -> list[str]:
        """This rank's view of the model, one comparable line per group and parameter."""
        lines = [f"fully_shard groups [{', '.join(g.label for g in self.groups)}]"]
        for g in self.groups:
            policy = g.policy.reshard_after_forward
            lines.append(f"group {g.label} (reshard_after_forward={policy}, mesh {_mesh_str(g.dp.mesh)})")
            for p in g.params:
                lines.append(_param_str(self.param_names[id(p)], p))
        return lines


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _param_str(fqn: str, p: ShardedParam) -> str:
    text = f"{fqn} {tuple(p.global_shape)} {str(p.orig_dtype).removeprefix('torch.')}"
    if not p.sharded.requires_grad:  # as it is now: it may have changed since fully_shard
        text += " requires_grad=False"
    if p.layout.dim != 0:
        text += f" Shard({p.layout.dim})"
    if p.param_dtype != p.orig_dtype or p.reduce_dtype != p.param_dtype:
        text += f" gathered as {p.param_dtype}, reduced in {p.reduce_dtype}"
    if p.tp is not None:
        text += f" tensor-parallel {tuple(p.tp[1])} on {_mesh_str(p.tp[0])}"
    if p.padded_local.is_meta:  # every rank then raises naming it; a rank alone on meta fails this check
        text += " on the meta device"
    return text


def _mesh_str(mesh: Any) -> str:
    """Shape, axis names and rank layout: of the whole mesh this one was sliced from.

    A sliced mesh's own rank layout differs between its slices by design (the
    ``dp`` ranks of TP rank 0 are not those of TP rank 1); the mesh it was cut
    from is the same on every rank.
    """
    root = root_mesh(mesh)
    names = root.mesh_dim_names or tuple(f"axis{i}" for i in range(root.ndim))
    shape = ", ".join(f"{n}={k}" for n, k in zip(names, root.mesh.shape))
    own = f"{mesh.mesh_dim_names} of " if root is not mesh and mesh.mesh_dim_names else ""
    return f"{own}({shape}) on {mesh.device_type}, ranks {root.mesh.tolist()}"


def _mesh_groups(groups: Sequence[GroupShape]) -> list[dist.ProcessGroup]:
    """The process groups of every axis of the model's meshes (data-parallel and TP), once each."""
    meshes = []
    for g in groups:
        meshes.append(g.dp.mesh)
        meshes.extend(p.tp[0] for p in g.params if p.tp is not None)
    seen, out = set(), []
    for mesh in meshes:
        for axis in range(mesh.ndim):
            pg = mesh.get_group(axis)
            ranks = tuple(dist.get_process_group_ranks(pg))
            if len(ranks) > 1 and ranks not in seen:
                seen.add(ranks)
                out.append(pg)
    return out


# ---- rank agreement -------------------------------------------------------------------
@_compat.outside_dispatch_modes()  # bookkeeping: a mode counting FSDP's collectives skips it
def check_rank_agreement(diag: Diagnostics) -> None:
    """Raise ``ValueError`` on every rank if ranks sharing the model built it differently.

    Ranks that disagree would issue collectives of different sizes or in a different
    order: a hang, a backend error far from the cause, or silently wrong numbers.
    """
    lines = diag.describe()
    digest = hashlib.sha256(json.dumps(lines).encode()).hexdigest()
    problem: str | None = None
    # Pass 1 finds differences along each axis; pass 2 spreads the verdict along every
    # axis again, so that a difference found along one axis reaches the whole mesh.
    for pg in diag.process_groups:
        digests = _gather(digest, pg)
        if problem is None and len(set(digests)) > 1:
            problem = _first_difference(_gather(lines, pg), pg)
        elif len(set(digests)) > 1:
            _gather(lines, pg)  # this rank already has a verdict, but its peers need its lines
    for pg in diag.process_groups:  # the smallest message, so that every rank reports the same one
        verdicts = [v for v in _gather(problem, pg) if v is not None]
        problem = min(verdicts) if verdicts else None
    if problem is not None:
        raise ValueError(
            f"fsdp2: ranks disagree on the sharded model: {problem}. Every rank must build the "
            "same model and call fully_shard on the same modules with the same arguments and meshes"
        )


def _gather(obj: Any, pg: dist.ProcessGroup) -> list[Any]:
    return _wire.all_gather_json(obj, pg)


def _first_difference(all_lines: list[list[str]], pg: dist.ProcessGroup) -> str:
    ranks = dist.get_process_group_ranks(pg)
    base = all_lines[0]
    for rank, lines in zip(ranks[1:], all_lines[1:]):
        for i in range(max(len(base), len(lines))):
            a = base[i] if i < len(base) else "nothing more"
            b = lines[i] if i < len(lines) else "nothing more"
            if a != b:
                return f"rank {ranks[0]} has {a}, rank {rank} has {b}"
    return f"ranks {ranks} describe the model differently"  # unreachable: the digests differed


# ---- all-gather headers ---------------------------------------------------------------
class HeaderSlot:
    """A group's all-gather header on CPU, rewritten in place at each all-gather: 16 bytes of a
    bytearray seen as a tensor (no tensor made per call), and the comparison of every rank's
    key (group index and phase) with its own, read in place (``keys_agree``).

    Safe to rewrite at the group's next all-gather: transports copy the header at issue (the
    flat one into its send slice, the exchange into its own row of the headers it sends), and
    the comparison reads the key before the group can issue another all-gather. Not used under
    a dispatch mode (a memory tracker, ``CommDebugMode``, the planner's fake tensors): there each
    all-gather makes its header as before, so what such a mode sees is unchanged.
    """

    __slots__ = ("raw", "tensor", "current", "_repeated")

    def __init__(self) -> None:
        self.raw = bytearray(16)
        self.tensor = torch.frombuffer(self.raw, dtype=torch.uint8)
        self.current = False  # it holds the header of the group's latest all-gather
        self._repeated: dict[tuple[int, bytes], memoryview] = {}  # (world, key) -> the key, world times

    def keys_agree(self, headers: torch.Tensor) -> bool:
        """Whether every row of ``headers`` ((world, HEADER) bytes in CPU memory, done) carries
        this slot's key in its second 8 bytes. Read where the rows are, as 8-byte integers (a
        strided memoryview over the rows' memory, compared with the key repeated): no tensor
        op, which would cost more than the comparison for a few hundred rows. False, for the
        caller's slower look, on any difference or where the rows are not 8-byte strided."""
        world, stride = headers.shape[0], headers.stride(0)
        if stride % 8 or headers.stride(1) != 1:
            return False
        key = bytes(self.raw[8:])
        mine = self._repeated.get((world, key))
        if mine is None:
            mine = self._repeated[(world, key)] = memoryview(key * world).cast("q")
        rows = (ctypes.c_char * ((world - 1) * stride + 8)).from_address(headers.data_ptr() + 8)
        return memoryview(rows).cast("B").cast("q")[::stride // 8] == mine


def before_all_gather(group: GroupShape, fmt: GatherFormat, pg: dist.ProcessGroup) -> torch.Tensor | None:
    """This rank's 16-byte header for the coming all-gather (None when unchecked); logs in debug mode."""
    root = group.root
    iteration = root.iteration if root is not None else -1
    phase = _debug.phase(root)
    cpu = group.device.type in ("cpu", "meta")  # (meta: the memory planner's groups, which play a CPU run)
    header = None
    if fmt.world > 1 and (cpu or _debug.enabled()):
        index = root.diag.index.get(id(group), -1) if root is not None and root.diag is not None else -1
        # Native-endian int32s, read back as such.
        slot = group.header_slot
        if cpu and not _compat.dispatch_modes_active():
            slot = slot or _new_header_slot(group)
            struct.pack_into("=4i", slot.raw, 0, ALL_GATHER_MAGIC, iteration, index, phase)
            slot.current = True
            header = slot.tensor
        else:  # a tensor of its own (on CUDA, debug mode: the copy to the device may read it later)
            if slot is not None:
                slot.current = False
            packed = struct.pack("=4i", ALL_GATHER_MAGIC, iteration, index, phase)
            header = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
    if _debug.enabled():
        _debug.log_collective("all_gather", group.label, pg, f"{fmt.slice_bytes} bytes per rank", torch.uint8, root)
    return header


def _new_header_slot(group: GroupShape) -> HeaderSlot:
    group.header_slot = HeaderSlot()
    return group.header_slot


def wait_all_gather(group: GroupShape, gather: AllGatherInFlight, pg: dist.ProcessGroup | None) -> None:
    """Wait for ``group``'s all-gather (errors name it) and compare the ranks' headers over
    ``pg`` (None: headers unchecked, ``before_all_gather`` returned none).

    When the headers travel ahead of the data (the exchange), they are compared first.
    """
    fmt = gather.fmt
    sizes = f"{fmt.world} ranks x {fmt.slice_bytes} bytes"
    headers_done = gather.headers_done()
    if headers_done is not None:
        _debug.wait(headers_done, "all_gather", group.label, sizes, group.root)
        _check_all_gather_headers(group, gather.headers, pg)
        _debug.wait(gather.done, "all_gather", group.label, sizes, group.root)
        return
    _debug.wait(gather.done, "all_gather", group.label, sizes, group.root)
    _check_all_gather_headers(group, gather.headers, pg)


def _check_all_gather_headers(group: GroupShape, headers: torch.Tensor, pg: dist.ProcessGroup | None) -> None:
    if pg is None or headers.is_meta:  # the memory planner's run (fsdp2/plan/_simulate.py): no bytes
        return
    # The usual case in one comparison, whatever the world size and without a copy: the header's
    # second 8 bytes (group index and phase) are the same on every rank (the iteration, in the
    # first 8, may differ). Anything else is rare: row by row below. On CPU (``HeaderSlot``)
    # every rank's key is read in place against this rank's own; elsewhere (CUDA in debug mode,
    # under a dispatch mode) a strided view of the keys against rank 0's (stride 0). All equal
    # to either is all equal; any difference goes the slow way below.
    slot = getattr(group, "header_slot", None)  # (a group, or a stand-in with its root only)
    if slot is not None and slot.current and headers.is_cpu and not _compat.dispatch_modes_active():
        if slot.keys_agree(headers):
            return
    else:
        world, stride, base = headers.shape[0], headers.stride(0), headers.storage_offset() + 8
        keys = headers.as_strided((world, 8), (stride, 1), base)
        if torch.equal(keys, headers.as_strided((world, 8), (0, 1), base)):  # on CUDA a device sync (debug mode only)
            return
    rows = headers.contiguous().view(torch.int32).cpu().tolist()  # (world, 4)
    if any(row[0] != ALL_GATHER_MAGIC for row in rows):
        return
    keys = [_schedule_key(row) for row in rows]
    if all(key == keys[0] for key in keys):
        return
    ranks = dist.get_process_group_ranks(pg)
    odd = next(r for r, key in enumerate(keys) if key != keys[0])
    raise RuntimeError(
        f"fsdp2: all-gathers of different groups matched up: rank {ranks[odd]} is gathering "
        f"{_what(group, rows[odd])} while rank {ranks[0]} is gathering {_what(group, rows[0])}: "
        "ranks ran different forward/backward sequences (a rank skipped or added a forward or a "
        "backward?). Every rank must run the same forwards and backwards in the same order"
    )


def _schedule_key(row: list[int]) -> tuple[int, int]:
    """What must agree: the group, and forward vs backward.

    Not the iteration: a forward that needed no collective on one rank only (all groups
    kept unsharded) shifts the counts without breaking the pairing. An explicit
    ``unshard()`` outside forward counts as forward (a manual prefetch).
    """
    _magic, _iteration, index, phase = row
    return index, 0 if phase == 2 else phase


def _what(group: GroupShape, row: list[int]) -> str:
    _magic, iteration, index, phase = row
    root = group.root
    labels = [g.label for g in root.diag.groups] if root is not None and root.diag is not None else []
    label = labels[index] if 0 <= index < len(labels) else f"group #{index}"
    where = _debug.PHASES[phase] if 0 <= phase < len(_debug.PHASES) else f"phase {phase}"
    return f"{label} in {where} of step {iteration + 1}"  # steps count root forwards from 1, as a loop does


# ---- reduce-scatter headers (exchange) ---------------------------------------------------
def reduce_header(group: GroupShape, params: Sequence[ShardedParam]) -> torch.Tensor:
    """16 bytes naming what this rank reduces: the group, and which of its parameters.

    ``[magic, group index, number of parameters, fingerprint of their indices]``.
    """
    root = group.root
    index = root.diag.index.get(id(group), -1) if root is not None and root.diag is not None else -1
    positions = {id(p): i for i, p in enumerate(group.params)}
    fingerprint = 0
    for p in params:
        fingerprint = (fingerprint * 1_000_003 + positions[id(p)] + 1) % (2**31 - 1)
    return torch.tensor([REDUCE_MAGIC, index, len(params), fingerprint], dtype=torch.int32).view(torch.uint8)


# ---- finite gradients -----------------------------------------------------------------
def record_nonfinite(root: RootShape, params: Sequence[ShardedParam], shards: Sequence[torch.Tensor]) -> None:
    """Count the non-finite elements of each reduced gradient shard (no sync; checked later)."""
    if root is None or root.diag is None:
        return
    for p, shard in zip(params, shards):
        count = shard.numel() - torch.isfinite(shard).sum()
        root.diag.nonfinite.append((root.diag.param_names.get(id(p), "?"), count))


@_compat.outside_dispatch_modes()
def raise_if_nonfinite(root: RootShape) -> None:
    """End of backward: agree across ranks on the first non-finite parameter; raise on every rank.

    Called once every reduce-scatter has finished and the groups are back to their
    end-of-backward state, so the module stays usable after the error.
    """
    diag = root.diag
    records, diag.nonfinite = diag.nonfinite, []
    if not records:  # no gradient was reduced (e.g. gradient sync off): the same on every rank
        return
    counts = torch.stack([c for _, c in records])
    n = len(records)
    positions = torch.arange(n, device=counts.device)
    first = torch.where(counts > 0, positions, n).min().reshape(1)
    for pg in diag.process_groups:
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=pg)
    index = int(first.item())
    if index == n:
        return
    by_rank = {dist.get_rank(): int(counts[index].item())}
    for pg in diag.process_groups:
        for other in _gather(sorted(by_rank.items()), pg):  # JSON: (rank, count) pairs, not int keys
            by_rank.update(other)
    found = ", ".join(f"{c} on rank {r}" for r, c in sorted(by_rank.items()) if c > 0)
    raise FloatingPointError(
        f"fsdp2: non-finite gradient in step {root.iteration + 1}: {records[index][0]} has "
        f"non-finite elements ({found}); the first such parameter in the order gradients were "
        "reduced (reverse forward order). The gradients were added to .grad: call "
        "optimizer.zero_grad() and skip this optimizer step, then continue"
    )
