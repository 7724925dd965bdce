"""In-memory snapshots: each rank's training state in shared memory that outlives the process.

A snapshot is one rank's local shards of the model's and the optimizer's state (``to_local()``
of every DTensor, in a fixed key order), the RNG states and a small ``extra`` (step, scheduler,
counters), written as raw bytes into a preallocated, memory-mapped file of the node's *area*
(a directory on a RAM file system, ``/dev/shm`` by default). The file outlives the process: a
rank killed by SIGKILL leaves its last snapshot behind for its restart. It does not outlive the
host, so snapshots never replace disk checkpoints.

Each file holds two slots, written alternately (double buffering)::

    [file header, 4 KiB: magic, owner rank, the newest step the owner finished]
    [slot 0: header (4 KiB) | payload: pickled table and extra, then every tensor's bytes]
    [slot 1: header (4 KiB) | payload]

A save first invalidates the slot it is about to overwrite (its header's magic zeroed), writes
the payload, takes its CRC-32 and commits the header last (run id, step, owner, world, layout
fingerprint, sizes, the payload's CRC-32, a generation counter and the header's own CRC-32).
A kill at any moment leaves the other slot intact and this one either invalid or failing its
checksum: a torn snapshot never loads. Readers check both CRCs.

With several nodes (``world_size / local_world_size`` of them), every rank also sends its
slot to the rank with the same local rank on the next node, which keeps it in a file of its own
(``peer-<owner>.snap``) in *its* node's area, on a gloo group of the snapshotter's own. After a
crash, :meth:`Snapshotter.newest` finds the newest step for which every rank's state is held
soundly somewhere (its own slot, else a peer's copy: a rank whose area is gone takes the copy
over the network), and :meth:`Snapshotter.restore` loads it.

With ``background=True`` a save returns once the tensors are copied into the slot (the only
part that reads the training state); the CRC-32, the header's commit and the peer copy run on a
thread of the snapshotter's own while training goes on. They read only the slot, which nothing
writes until the next save, and that save (like :meth:`Snapshotter.wait`, :meth:`newest`,
:meth:`restore` and :meth:`close`) first waits for them. A kill before the commit leaves the
slot invalid and the previous snapshot the newest: at most one snapshot more is lost.

Files are locked (``fcntl.flock``) by the live process that writes them: a second run
pointed at the same area is refused, while a restart of the same run (its processes dead,
their locks released) resumes from what they left. See docs/checkpointing.md.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import pickle
import socket
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._wire import all_gather_json, as_memoryview

__all__ = ["Snapshotter", "SnapshotPlan", "SnapshotAreaError", "snapshot_area"]

logger = logging.getLogger(__name__)

_MAGIC = b"FSDP2SNP"
_VERSION = 1
_PAGE = 4096
# magic, version, owner, world, step, generation, payload bytes, payload CRC, meta bytes, fingerprint, run id
_HEADER = struct.Struct("<8sIIIqQQIQ16s64s")
_FILE_HEADER = struct.Struct("<8sIIq")  # magic, version, owner, newest finished step
_PROGRESS_AT = 16  # offset of the newest finished step in the file header


class SnapshotAreaError(ValueError):
    """The snapshot area cannot be used: missing, unwritable, too small, or another run's."""


def snapshot_area(root: str | os.PathLike, node: str | None = None) -> Path:
    """This node's area under ``root``: ``root/node-<name>``, the name ``FSDP2_NODE``'s where set
    (two nodes simulated on one machine, docs/multi-node.md), else the host name."""
    name = node if node is not None else os.environ.get("FSDP2_NODE") or socket.gethostname()
    return Path(root) / f"node-{name}"


class SlotHeader(NamedTuple):
    owner: int
    world: int
    step: int
    generation: int
    payload_bytes: int
    crc: int
    meta_bytes: int
    fingerprint: bytes
    run_id: str

    def pack(self) -> bytes:
        body = _HEADER.pack(_MAGIC, _VERSION, self.owner, self.world, self.step, self.generation,
                            self.payload_bytes, self.crc, self.meta_bytes, self.fingerprint,
                            self.run_id.encode()[:64])
        return body + struct.pack("<I", zlib.crc32(body))

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> SlotHeader | None:
        """The header in ``raw``, or None where it is invalidated, torn or of another format."""
        body = bytes(raw[: _HEADER.size])
        (crc,) = struct.unpack_from("<I", raw, _HEADER.size)
        if body[:8] != _MAGIC or zlib.crc32(body) != crc:
            return None
        _, version, *fields = _HEADER.unpack(body)
        if version != _VERSION:
            return None
        fields[-1] = fields[-1].rstrip(b"\0").decode(errors="replace")
        return cls(*fields)


@dataclass
class _File:
    """One memory-mapped snapshot file (own or a peer's copy), locked by this process."""

    path: Path
    fd: int
    map: mmap.mmap
    slot_bytes: int  # header page + payload capacity
    generation: int = 0  # of the newest slot written here

    @property
    def bytes(self) -> torch.Tensor:
        return torch.frombuffer(self.map, dtype=torch.uint8)

    def slot(self, index: int) -> torch.Tensor:
        """Slot ``index`` (0 or 1), header page then payload, as a uint8 tensor over the mapping."""
        start = _PAGE + index * self.slot_bytes
        return self.bytes[start:start + self.slot_bytes]


class SnapshotPlan(NamedTuple):
    """What :meth:`Snapshotter.newest` agreed on: the step, and for each rank the rank holding it."""

    step: int
    holders: list[int]  # holders[owner]: the rank whose area holds owner's snapshot (owner itself if it can)
    lost: int  # steps finished after ``step`` that are lost (the newest finished step any file records - step)


class _Found(NamedTuple):
    owner: int
    step: int
    file: Path
    slot: int


class Snapshotter:
    """Writes this rank's snapshots into its node's area and restores the newest one all ranks hold.

    Collective where noted (every rank of the default group calls it). Construct it before the
    model is allocated: it checks the area and takes the locks; the files are allocated at the
    first :meth:`save`, once the optimizer's state exists.

    Args:
        root: the snapshot directory; this node's area is ``root/node-<name>`` (:func:`snapshot_area`).
        run_id: names the run; an area holding another run's snapshots is refused.
        local_world_size: ranks per node (torchrun's ``LOCAL_WORLD_SIZE``); the nodes are
            ``world // local_world_size``. One node: no peer copies.
        node: this node's name (default ``FSDP2_NODE``, else the host name).
        peer_copy: send each snapshot to a rank of the next node (only with several nodes).
        background: :meth:`save` returns once the state is copied into the slot; the checksum,
            the commit and the peer copy finish on a background thread (see :meth:`wait`). Kept
            as the attribute ``background``, which may change between saves.

    ``last_cost``: the newest finished save's seconds: ``waited`` (for the previous save's
    background part), ``copy`` (both kept the caller), ``checksum`` and ``peer`` (the caller's
    time, or the background thread's with ``background=True``).
    """

    def __init__(self, root: str | os.PathLike, *, run_id: str, local_world_size: int | None = None,
                 node: str | None = None, peer_copy: bool = True, background: bool = False) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local_world = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        if self.world % self.local_world:
            raise ValueError(f"local_world_size={self.local_world} does not divide the world size {self.world}")
        self.nodes = self.world // self.local_world
        self.area = snapshot_area(root, node)
        self.run_id = run_id
        self.peer = peer_copy and self.nodes > 1
        self.dest = (self.rank + self.local_world) % self.world  # holds this rank's copy
        self.source = (self.rank - self.local_world) % self.world  # whose copy this rank holds
        self.group = dist.new_group(backend="gloo")  # snapshot traffic never interleaves with training's
        self.own: _File | None = None
        self.copy: _File | None = None
        self._locks: list[int] = []
        self.background = background
        self._pending: _Pending | None = None
        problem = None
        try:
            for path in [self._own_path, *([self._peer_path] if self.peer else [])]:
                self._locks.append(self._claim(path))
        except SnapshotAreaError as e:
            problem = str(e)
        # Every rank stops alike (another run may hold one rank's file only): rank order's first problem.
        if problem := next((p for p in all_gather_json(problem, self.group) if p is not None), None):
            self.close()
            raise SnapshotAreaError(problem)
        self.last_cost: dict[str, float] = {}

    # ---- the area --------------------------------------------------------------------------
    @property
    def _own_path(self) -> Path:
        return self.area / f"rank-{self.rank}.snap"

    @property
    def _peer_path(self) -> Path:
        return self.area / f"peer-{self.source}.snap"

    def _claim(self, path: Path) -> int:
        """Create (or open) ``path`` and lock it; raise SnapshotAreaError naming what is wrong."""
        try:
            self.area.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise SnapshotAreaError(f"snapshot area {self.area} is not writable ({e.strerror}): choose another "
                                    "checkpoint.snapshot_dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SnapshotAreaError(f"snapshot area {self.area} is in use by another run (a live process holds the "
                                    f"lock of {path.name}): stop it or choose another checkpoint.snapshot_dir"
                                    ) from None
        other = _run_ids(path) - {self.run_id}
        if other:
            os.close(fd)
            raise SnapshotAreaError(f"snapshot area {self.area} holds another run's snapshots (run id "
                                    f"{sorted(other)[0]}, this run's is {self.run_id}): remove it (rm -r {self.area}) "
                                    "or choose another checkpoint.snapshot_dir")
        return fd

    def _map(self, fd: int, path: Path, slot_bytes: int, previous: _File | None) -> _File:
        """Size ``fd``'s file for two slots of ``slot_bytes`` (reserving the memory now) and map it;
        ``previous``: its mapping so far, dropped (a file sized again keeps no snapshot)."""
        if previous is not None:
            _unmap(previous)
        size = _PAGE + 2 * slot_bytes
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, 0)  # another layout's slots: never read again
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                free = _free_bytes(self.area)
                raise SnapshotAreaError(f"snapshot area {self.area} is too small: {path.name} needs {size} bytes, "
                                        f"{free} are free ({e.strerror}); free memory there or choose another "
                                        "checkpoint.snapshot_dir") from None
        file = _File(path, fd, mmap.mmap(fd, size), slot_bytes)
        headers = [SlotHeader.unpack(memoryview(file.map)[_PAGE + i * slot_bytes:]) for i in range(2)]
        file.generation = max((h.generation for h in headers if h is not None), default=0)
        file.map[:_FILE_HEADER.size] = _FILE_HEADER.pack(_MAGIC, _VERSION, self.rank, -1)
        return file

    def record_progress(self, step: int) -> None:
        """Note that this rank finished ``step`` (8 bytes in its file): the restart counts the steps lost."""
        if self.own is not None:
            struct.pack_into("<q", self.own.map, _PROGRESS_AT, step)

    def close(self, *, remove: bool = False, wait: bool = True) -> None:
        """Unmap and unlock; ``remove`` also deletes this rank's files (a run that finished).

        ``wait``: first finish the save in flight (collective with peer copies). ``False`` (a run
        that is failing, whose peers may never take their part of the copy) does not wait: the
        save commits if it still can, else its slot stays invalid and the previous snapshot the
        newest; the files stay mapped and locked until it ends (or the process does).
        """
        if wait:
            self.wait()
        if self._pending is not None:  # unmapped under the save's thread, its next access would segfault
            self._pending.then(self._release)
        else:
            self._release()
        if remove:
            for path in (self._own_path, self._peer_path):
                path.unlink(missing_ok=True)
            try:
                self.area.rmdir()
            except OSError:
                pass  # another rank's files are still there

    def _release(self) -> None:
        for file in (self.own, self.copy):
            if file is not None:
                _unmap(file)
        for fd in self._locks:
            os.close(fd)
        self._locks, self.own, self.copy = [], None, None

    # ---- saving ----------------------------------------------------------------------------
    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             extra: dict[str, Any] | None = None) -> None:
        """Collective (with peer copies): snapshot this rank's state at ``step`` into the slot not
        holding the newest snapshot, then send it to the peer. ``extra``: small picklable state.

        Waits for the previous save's background part first. Returns once the state is copied
        into the slot (``background=True``: ``model`` and ``optimizer`` may change from then on)
        or, by default, once the snapshot is committed and sent.

        The first save sizes and maps the file; later ones reuse it, unless the state grew (an
        optimizer state that appeared late, a larger ``extra``): then the file is sized again.
        """
        t0 = time.perf_counter()
        self.wait()
        t1 = time.perf_counter()
        tensors = _tensors(model, optimizer)
        info = _meta(tensors, optimizer, extra)
        meta = pickle.dumps(info, protocol=pickle.HIGHEST_PROTOCOL)
        if self.own is None or len(meta) > self._meta_capacity:
            self._meta_capacity = _round_up(max(64 * 2**10, 4 * len(meta)))
        info["offsets"], end = _layout(tensors, self._meta_capacity)
        meta = pickle.dumps(info, protocol=pickle.HIGHEST_PROTOCOL)
        if self.own is None or _PAGE + end > self.own.slot_bytes:
            self._fingerprint = _fingerprint(tensors, self.world)
            self.own = self._map(self._locks[0], self._own_path, _round_up(_PAGE + end), self.own)
        own = self.own
        own.generation += 1
        slot = own.slot(own.generation % 2)
        slot[:8].zero_()  # invalidated first: a kill from here on leaves this slot unreadable
        payload = slot[_PAGE:]
        payload[:len(meta)].copy_(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
        for (_, tensor), offset in zip(tensors, info["offsets"]):
            n = tensor.numel() * tensor.element_size()
            payload[offset:offset + n].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        header = SlotHeader(self.rank, self.world, step, own.generation, end, 0, len(meta), self._fingerprint,
                            self.run_id)
        cost = {"waited": t1 - t0, "copy": time.perf_counter() - t1}
        if self.background:
            self._pending = _Pending(self._commit, slot, header, cost)
        else:
            self._commit(slot, header, cost)

    def _commit(self, slot: torch.Tensor, header: SlotHeader, cost: dict[str, float]) -> None:
        """The slot's CRC-32 and header (committed), then the peer copy; sets ``last_cost``."""
        t0 = time.perf_counter()
        region = slot[:_PAGE + header.payload_bytes]
        header = header._replace(crc=zlib.crc32(as_memoryview(region[_PAGE:])))
        packed = header.pack()
        slot[:len(packed)].copy_(torch.frombuffer(bytearray(packed), dtype=torch.uint8))  # committed
        t1 = time.perf_counter()
        if self.peer:
            self._send_copy(region)
        self.last_cost = {**cost, "checksum": t1 - t0, "peer": time.perf_counter() - t1}

    def wait(self) -> None:
        """Block until the save in flight (``background=True``) is committed and its peer copy
        sent; re-raise what failed there. Returns at once when none is in flight. Collective with
        peer copies, as the save was."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()

    def _send_copy(self, region: torch.Tensor) -> None:
        """Send this slot to ``dest`` and receive ``source``'s into the peer file's older slot."""
        n = torch.tensor([region.numel()], dtype=torch.int64)
        got = torch.zeros(1, dtype=torch.int64)
        _exchange([(n, self.dest)], [(got, self.source)], self.group)
        if self.copy is None or int(got) > self.copy.slot_bytes:  # the first copy, or the source's state grew
            self.copy = self._map(self._locks[1], self._peer_path, _round_up(int(got)), self.copy)
        copy = self.copy
        copy.generation += 1
        target = copy.slot(copy.generation % 2)
        target[:8].zero_()
        _exchange([(region, self.dest)], [(target[:int(got)], self.source)], self.group)

    # ---- finding and restoring -------------------------------------------------------------
    def newest(self, model: torch.nn.Module) -> SnapshotPlan | None:
        """Collective: the newest step whose snapshot every rank can restore soundly, or None.

        Each rank checks the files of its node's area whose owners share its local rank (every
        file is read by one rank): both slots' headers (run id, world, layout fingerprint) and
        payload CRC-32. The sound (owner, step) pairs, two newest per owner, are all-gathered as
        a tensor; a step counts when every owner holds it itself or some rank holds its copy.
        """
        self.wait()
        fingerprint = _fingerprint(_tensors(model, None), self.world)
        self._found = [f for f in self._scan() if self._check_fingerprint(f, fingerprint)]
        table = torch.full((self.world, 3), -1, dtype=torch.int64)  # per owner: two newest steps, progress
        for owner in range(self.world):
            steps = sorted({f.step for f in self._found if f.owner == owner}, reverse=True)[:2]
            table[owner, :len(steps)] = torch.tensor(steps, dtype=torch.int64)
        table[self.rank, 2] = self._progress()
        gathered = [torch.zeros_like(table) for _ in range(self.world)]
        dist.all_gather(gathered, table, group=self.group)
        tables = torch.stack(gathered)  # (holder, owner, 3)
        finished = int(tables[:, :, 2].max())
        candidates = sorted({int(s) for s in tables[:, :, :2].flatten().tolist() if s >= 0}, reverse=True)
        for step in candidates:
            holds = (tables[:, :, :2] == step).any(dim=2)  # holds[h, owner]
            if bool(holds.any(dim=0).all()):
                holders = [owner if holds[owner, owner] else int(holds[:, owner].nonzero()[0])
                           for owner in range(self.world)]
                return SnapshotPlan(step, holders, max(0, finished - step))
        return None

    def restore(self, plan: SnapshotPlan, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Collective: load ``plan``'s snapshot into ``model`` and ``optimizer`` and the RNG states;
        returns its ``extra``. A rank whose snapshot another rank holds receives it on the gloo group."""
        self.wait()
        regions = {o: self._open_region(self._held(o, plan.step)) for o in range(self.world)
                   if plan.holders[o] == self.rank}
        holder = plan.holders[self.rank]
        sends = [(region, owner) for owner, region in regions.items() if owner != self.rank]
        n = torch.zeros(1, dtype=torch.int64)  # sizes first: a rank whose area is gone knows none
        _exchange([(torch.tensor([r.numel()], dtype=torch.int64), o) for r, o in sends],
                  [(n, holder)] if holder != self.rank else [], self.group)
        mine = regions.get(self.rank)
        if mine is None:
            mine = torch.empty(int(n), dtype=torch.uint8)
        _exchange(sends, [(mine, holder)] if holder != self.rank else [], self.group)
        header = SlotHeader.unpack(as_memoryview(mine))
        if header is None or header.step != plan.step or zlib.crc32(
                as_memoryview(mine[_PAGE:_PAGE + header.payload_bytes])) != header.crc:
            raise RuntimeError(f"snapshot: rank {self.rank}'s snapshot of step {plan.step} was damaged on its way")
        return _load(mine[_PAGE:], header, model, optimizer)

    def _open_region(self, found: _Found) -> torch.Tensor:
        with open(found.file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            slot_bytes = (len(m) - _PAGE) // 2
            start = _PAGE + found.slot * slot_bytes
            header = SlotHeader.unpack(memoryview(m)[start:])
            return torch.frombuffer(bytearray(m[start:start + _PAGE + header.payload_bytes]), dtype=torch.uint8)

    def _held(self, owner: int, step: int) -> _Found:
        return next(f for f in self._found if f.owner == owner and f.step == step)

    def _scan(self) -> list[_Found]:
        """Sound slots of the files in this node's area whose owners share this rank's local rank."""
        found = []
        if not self.area.is_dir():
            return found
        for path in sorted(self.area.glob("*.snap")):
            try:
                owner = int(path.stem.split("-")[1])
            except (IndexError, ValueError):
                continue
            if owner % self.local_world != self.rank % self.local_world or owner >= self.world:
                continue
            found += [_Found(owner, h.step, path, i) for i, h in _sound_slots(path, self.run_id, self.world)
                      if h.owner == owner]
        return found

    def _check_fingerprint(self, found: _Found, fingerprint: bytes) -> bool:
        return found.owner != self.rank or _header_of(found).fingerprint == fingerprint

    def _progress(self) -> int:
        try:
            with open(self._own_path, "rb") as f:
                raw = f.read(_FILE_HEADER.size)
            magic, _, _, step = _FILE_HEADER.unpack(raw)
            return step if magic == _MAGIC else -1
        except (OSError, struct.error):
            return -1


# ---- helpers --------------------------------------------------------------------------------
class _Pending:
    """A save's background part, running on a daemon thread (a process that ends or dies
    mid-way leaves the slot uncommitted, never waits for it); :meth:`join` re-raises its error."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._done = False
        self._after: Any = None
        self.thread = threading.Thread(target=self._run, args=(fn, *args), name="fsdp2-snapshot", daemon=True)
        self.thread.start()

    def _run(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as e:  # re-raised on the caller's thread by join()
            self.error = e
        finally:
            with self._lock:
                self._done, after = True, self._after
            if after is not None:
                after()

    def then(self, after: Any) -> None:
        """Call ``after()`` once the work has ended: on its thread, or now if it already has."""
        with self._lock:
            if not self._done:
                self._after = after
                return
        after()

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"snapshot: the background part of a save failed: {self.error}") from self.error


def _exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
              group: dist.ProcessGroup) -> None:
    """Point to point on ``group``: every (tensor, global rank) of ``sends`` sent, of ``recvs``
    received; every receive is posted before any send is waited on, so no pair of ranks deadlocks."""
    works = [dist.irecv(t, src=src, group=group) for t, src in recvs]
    works += [dist.isend(t.contiguous(), dst=dst, group=group) for t, dst in sends]
    for work in works:
        work.wait()


def _unmap(file: _File) -> None:
    try:
        file.map.close()
    except BufferError:  # a tensor still views it: unmapped once that is gone (or the process ends)
        pass


def _layout(tensors: list[tuple[str, torch.Tensor]], start: int) -> tuple[list[int], int]:
    """Each tensor's offset in the payload, from ``start``, 64-byte aligned (a view as any dtype
    needs its offset aligned to the element size); and where the last one ends."""
    offsets, offset = [], start
    for _, tensor in tensors:
        offset = -(-offset // 64) * 64
        offsets.append(offset)
        offset += tensor.numel() * tensor.element_size()
    return offsets, offset


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def _tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the snapshot, in a fixed order: the model's state dict, then the optimizer's
    state by parameter index (the index ``Optimizer.state_dict`` uses) and name."""
    out = [(f"model/{k}", _local(v).detach()) for k, v in model.state_dict().items() if torch.is_tensor(v)]
    if optimizer is not None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for i, p in enumerate(params):
            for name, value in sorted(optimizer.state.get(p, {}).items()):
                if torch.is_tensor(value):
                    out.append((f"optim/{i}/{name}", _local(value).detach()))
    return out


def _meta(tensors: list[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer,
          extra: dict[str, Any] | None) -> dict[str, Any]:
    """What the payload's bytes are: the tensor table, the optimizer's structure, RNG and ``extra``."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    # Per state entry: a tensor's kind (a DTensor or not, on the CPU or the parameter's device), or its value.
    state = {i: {name: ({"dtensor": isinstance(v, DTensor), "cpu": v.device.type == "cpu"} if torch.is_tensor(v)
                        else {"value": v})
                 for name, v in optimizer.state.get(p, {}).items()} for i, p in enumerate(params)}
    groups, index = [], 0
    for group in optimizer.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(index, index + len(group["params"])))})
        index += len(group["params"])
    rng = {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})}
    return {"table": [(k, t.dtype, tuple(t.shape)) for k, t in tensors], "optim_state": state,
            "param_groups": groups, "rng": rng, "extra": extra or {}}


def _load(payload: torch.Tensor, header: SlotHeader, model: torch.nn.Module,
          optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Copy a payload's tensors into the model and a rebuilt optimizer state; set the RNG; its extra."""
    meta = pickle.loads(as_memoryview(payload[:header.meta_bytes]))
    values: dict[str, torch.Tensor] = {}
    for (key, dtype, shape), offset in zip(meta["table"], meta["offsets"]):
        values[key] = payload[offset:offset + _nbytes(dtype, shape)].view(dtype).view(shape)
    with torch.no_grad():
        for key, value in model.state_dict().items():
            _local(value).copy_(values[f"model/{key}"])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for i, entries in meta["optim_state"].items():
        p, state[i] = params[i], {}
        for name, kind in entries.items():
            if "value" in kind:
                state[i][name] = kind["value"]
                continue
            local = values[f"optim/{i}/{name}"].to("cpu" if kind["cpu"] else p.device, copy=True)
            state[i][name] = (DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                                 stride=p.stride()) if kind["dtensor"] else local)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    torch.set_rng_state(meta["rng"]["cpu"])
    if "cuda" in meta["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(meta["rng"]["cuda"])
    return meta["extra"]


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _fingerprint(tensors: list[tuple[str, torch.Tensor]], world: int) -> bytes:
    """16 bytes naming the model part's layout: keys, dtypes and local shapes, and the world size."""
    text = repr([(k, str(t.dtype), tuple(t.shape)) for k, t in tensors if k.startswith("model/")] + [world])
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _round_up(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _headers(path: Path) -> list[tuple[int, SlotHeader | None, int, int]]:
    """(slot, header, start, slot bytes) of both slots of ``path``'s file; [] where it holds no slots."""
    try:
        size = path.stat().st_size
        if size < _PAGE * 3:
            return []
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            slot_bytes = (size - _PAGE) // 2
            return [(i, SlotHeader.unpack(memoryview(m)[_PAGE + i * slot_bytes:][:_PAGE]), _PAGE + i * slot_bytes,
                     slot_bytes) for i in range(2)]
    except OSError:
        return []


def _run_ids(path: Path) -> set[str]:
    return {h.run_id for _, h, _, _ in _headers(path) if h is not None}


def _header_of(found: _Found) -> SlotHeader:
    return next(h for i, h, _, _ in _headers(found.file) if i == found.slot)


def _sound_slots(path: Path, run_id: str, world: int) -> list[tuple[int, SlotHeader]]:
    """The slots of ``path`` whose header is valid, of this run and world, and whose payload matches its CRC-32."""
    sound = []
    for i, header, start, slot_bytes in _headers(path):
        if header is None or header.run_id != run_id or header.world != world:
            continue
        if header.payload_bytes > slot_bytes - _PAGE:
            continue
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if zlib.crc32(memoryview(m)[start + _PAGE:start + _PAGE + header.payload_bytes]) == header.crc:
                sound.append((i, header))
            else:
                logger.warning("snapshot: %s slot %d (step %d) does not match its checksum: never loaded",
                               path, i, header.step)
    return sound
