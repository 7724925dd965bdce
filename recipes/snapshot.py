"""Recipe snapshots: ``--checkpoint.snapshot_every=K|auto`` keeps each rank's state in host memory.

Every K steps each rank writes its shards, the optimizer's, the RNG states and the recipe's
extra state (scheduler, skip counters, step) into its node's snapshot area with
:class:`fsdp2.checkpoint.Snapshotter` (default area ``/dev/shm/fsdp2-<run id>``, the run id
torchrun's ``--rdzv-id``, a fresh one per ``--standalone`` launch), and with several nodes a
copy goes to a rank of the next node. Under ``torchrun --max-restarts`` a crashed run resumes
from the newest snapshot every rank holds soundly, or from the newest sound disk checkpoint when
that is as new; one line says which and how many finished steps were lost. ``auto`` measures a
snapshot's cost and a step's time in the first steps and picks the smallest K whose copies cost
at most 2% of the step time. ``--checkpoint.snapshot_background``: with it, only the copy into
the slot holds the step, the checksum and the peer copy run while the next steps train
(``Snapshotter.background``); ``auto`` (the default) snapshots in the background on one node
and waits for the whole snapshot with peer copies, where the background copy measured slower.
A run that finishes removes its snapshots; disk checkpoints stay the only state that outlives
the host. See docs/checkpointing.md.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp2.checkpoint import SnapshotAreaError, Snapshotter

from .checkpoint import Checkpointer
from .config import FaultsConfig, JobConfig
from .pipeline import full_parameter_count

__all__ = ["Snapshots", "SnapshotAreaError", "check_snapshots", "snapshot_root", "snapshot_bytes", "run_id",
           "kill_if_asked", "BUDGET"]

logger = logging.getLogger(__name__)
BUDGET = 0.02  # auto: the largest share of the step time snapshots may cost
_PAGE = 4096


def run_id() -> str:
    """The run's identity: torchrun's rendezvous id (the same for every restart of one launch)."""
    return os.environ.get("TORCHELASTIC_RUN_ID", "local")


def snapshot_root(config: JobConfig) -> Path:
    return Path(config.checkpoint.snapshot_dir or f"/dev/shm/fsdp2-{run_id()}")


def snapshot_bytes(n_params: int, world_size: int, local_world_size: int, nodes: int) -> int:
    """About the bytes one node's area needs: per rank two slots of its shards of the fp32 parameters
    and AdamW's two moments (with a 64 KiB table each), twice with a peer's copy."""
    per_rank = 2 * (3 * 4 * -(-n_params // world_size) + 64 * 2**10 + 2 * _PAGE)
    return local_world_size * per_rank * (2 if nodes > 1 else 1)


def check_snapshots(config: JobConfig, world_size: int) -> None:
    """Raise ValueError, before any collective, when the snapshot area is missing, unwritable or too small."""
    every = config.checkpoint.snapshot_every
    if every == "off":
        return
    root = snapshot_root(config)
    where = f"checkpoint.snapshot_dir={root}"
    if not root.parent.is_dir():
        raise ValueError(f"{where}: {root.parent} is missing (no RAM file system there?); create it or choose "
                         "another checkpoint.snapshot_dir (e.g. /dev/shm/NAME)")
    existing = root if root.exists() else root.parent
    if not existing.is_dir():
        raise ValueError(f"{where} is a file, not a directory; choose another checkpoint.snapshot_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{where}: {existing} is not writable; choose another checkpoint.snapshot_dir")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    need = snapshot_bytes(full_parameter_count(config)[0], world_size, local, world_size // max(1, local))
    held = sum(f.stat().st_size for f in root.rglob("*.snap")) if root.is_dir() else 0  # this run's, reused
    free = shutil.disk_usage(existing).free + held
    if free < need:
        raise ValueError(f"{where} is too small: snapshots need about {need} bytes on this node, {free} are free; "
                         "free memory there, choose another checkpoint.snapshot_dir or snapshot fewer ranks per node")


def kill_if_asked(faults: FaultsConfig, step: int) -> None:
    """``faults.kill_after_step``: SIGKILL this rank (``faults.kill_rank``, -1: every rank) after
    ``step``, in torchrun's first attempt only (its restart must recover)."""
    if step != faults.kill_after_step or faults.kill_rank not in (-1, dist.get_rank()):
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class Snapshots:
    """The recipe's snapshots; every method is collective. Construct before allocating the model
    (the area is claimed: one line if another run uses it)."""

    def __init__(self, config: JobConfig) -> None:
        every = config.checkpoint.snapshot_every
        self.auto = every == "auto"
        self.every = 0 if self.auto else int(every)  # 0: chosen at the second snapshot
        self.snapshotter = s = Snapshotter(snapshot_root(config), run_id=run_id())
        background = config.checkpoint.snapshot_background
        s.background = not s.peer if background == "auto" else background
        self.taken = 0
        self.last_step_end: float | None = None
        self.step_seconds = 0.0
        where = (f"a copy to rank r + {s.local_world} on the next node ({s.nodes} nodes)" if s.peer
                 else "one node: no peer copy, the snapshots do not survive the node")
        when = f"every {self.every} steps" if self.every else "every step until measured (auto)"
        how = ("the checksum and peer copy in the background" if s.peer else "the checksum in the background"
               ) if s.background else "the step waits for each whole snapshot"
        _info("snapshot: %s in %s; %s; %s", when, s.area, where, how)

    # ---- resuming -----------------------------------------------------------------------------
    def resume(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, checkpointer: Checkpointer | None,
               guard: Any) -> int:
        """Load the newest snapshot all ranks hold, or the newest sound checkpoint when it is as new;
        returns the step (0: a fresh start). Logs one line: where from and the steps lost."""
        plan = self.snapshotter.newest(model)
        disk = checkpointer.choose() if checkpointer is not None else None
        if plan is not None and (disk is None or plan.step > disk):
            extra = self.snapshotter.restore(plan, model, optimizer)
            scheduler.load_state_dict(extra["scheduler"])
            guard.load_state_dict(extra["skips"])
            _info("resumed from snapshot %s step %d (lost %d steps)", self.snapshotter.area, plan.step, plan.lost)
            return plan.step
        extra = checkpointer.resume(model, optimizer, scheduler) if checkpointer is not None else None
        if extra is None:
            return 0
        guard.load_state_dict(extra.get("skips", {"total": 0, "in_a_row": 0}))
        finished = plan.step + plan.lost if plan is not None else extra["step"]
        lost = f"lost {finished - extra['step']} steps" if plan is not None else "no snapshot to compare"
        _info("resumed from checkpoint %s step %d (%s)", checkpointer.root, extra["step"], lost)
        return extra["step"]

    # ---- during training ----------------------------------------------------------------------
    def after_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler, guard: Any) -> None:
        """Snapshot ``step`` when due; the second snapshot's cost is measured, printed (and sets K under auto)."""
        now = time.perf_counter()
        if self.last_step_end is not None:
            self.step_seconds = now - self.last_step_end
        if not self.every or step % self.every == 0:
            extra = {"step": step, "scheduler": scheduler.state_dict(), "skips": guard.state_dict()}
            self.snapshotter.save(step, model, optimizer, extra=extra)
            self.taken += 1
            if self.taken == 2:  # the first one allocates and touches the memory: not a fair measure
                self._measured(step)
        self.snapshotter.record_progress(step)
        self.last_step_end = time.perf_counter()

    def _measured(self, step: int) -> None:
        """Agree on the slowest rank's figures; print them; under auto, choose K.

        The cost counted is the whole snapshot's work, its background part included (as if none
        of it overlapped the step): on a machine whose cores the step keeps busy, little does."""
        self.snapshotter.wait()  # this snapshot's background part: its figures (and the group is free)
        cost = self.snapshotter.last_cost
        parts = [cost["waited"] + cost["copy"], cost["checksum"], cost["peer"]]
        figures = torch.tensor([sum(parts), self.step_seconds, *parts], dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.snapshotter.group)
        total, step_s, copy, crc, peer = figures.tolist()
        if not self.every:
            self.every = max(1, math.ceil(total / (BUDGET * step_s))) if step_s > 0 else 1
        split = (f"copy {1e3 * copy:.1f}, holding the step; in the background: checksum {1e3 * crc:.1f}, "
                 f"peer copy {1e3 * peer:.1f}") if self.snapshotter.background else \
            f"copy {1e3 * copy:.1f}, checksum {1e3 * crc:.1f}, peer copy {1e3 * peer:.1f}"
        _info("snapshot: every %d steps; measured at step %d: one snapshot costs %.1f ms (%s), a step %.1f ms: "
              "%.2f%% of the step time per step%s", self.every, step, 1e3 * total, split, 1e3 * step_s,
              100 * total / self.every / max(step_s, 1e-9),
              f" (auto: the smallest interval within {BUDGET:.0%})" if self.auto else "")

    def close(self, *, finished: bool) -> None:
        """Release the area; a finished run removes its snapshots (a crashed one keeps them for its restart,
        leaving a snapshot still in the background unfinished: its peers may never take their part)."""
        self.snapshotter.close(remove=finished, wait=finished)
        if finished:
            try:
                self.snapshotter.area.parent.rmdir()  # the run's directory, once every node's area is gone
            except OSError:
                pass


def _info(message: str, *args: Any) -> None:
    if dist.get_rank() == 0:
        logger.info(message, *args)

