"""In-memory snapshots (``fsdp2.checkpoint.Snapshotter``) on real gloo ranks and real files.

Two ranks train a small ``fully_shard``-ed model with AdamW and snapshot after every step into
a temporary area; a fresh model and optimizer (as after a restart) restore the newest snapshot
every rank holds and take the same next steps bit for bit. Two nodes are simulated by giving
each rank a node of its own (``node=``, one rank per node): each snapshot then also goes to the
other rank, which keeps it in its own area, so a rank whose area is deleted takes its peer's
copy. A slot whose bytes are overwritten (a torn or damaged snapshot) never loads: the restore
falls back to the older slot. An area another live run holds, or one holding another run's
snapshots, is refused in one line; an area that cannot be created too.
"""

from __future__ import annotations

import fcntl
import shutil
import threading

import pytest
import torch
import torch.distributed as dist

import fsdp2
from fsdp2.checkpoint import SnapshotAreaError, Snapshotter, snapshot_area
from tests._dist import run_on_ranks


class _Model(torch.nn.Module):
    """Two layers, a third used from step 3 on (its optimizer state appears late: the snapshot grows),
    and a 3-byte buffer (the tensors after it must still be aligned in the snapshot)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.late = torch.nn.Sequential(torch.nn.Linear(4, 512), torch.nn.Linear(512, 4))  # 36 KiB of moments
        self.register_buffer("flags", torch.arange(3, dtype=torch.int8))

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:  # (batch, 8) -> (batch, 4)
        y = self.second(torch.relu(self.first(x)))
        return self.late(y) if step >= 3 else y


def _build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _Model()
    fsdp2.fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randn(4, 8, generator=gen)
    loss = model(x, step).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _train_snapshot_restore(root: str, two_nodes: bool, damage: str,
                            background: bool) -> tuple[list[float], list[float], tuple]:
    """Train 4 steps with a snapshot after each (and 2 more: the uninterrupted run), damage as told,
    restore into a fresh model and optimizer and train to step 6. Returns the uninterrupted losses
    after the restored step, the restored run's, and (restored step, holders, steps lost, extra).
    ``background``: each snapshot's checksum and peer copy run while the next step trains."""
    node = str(dist.get_rank()) if two_nodes else "0"
    local = 1 if two_nodes else 2
    model, optimizer = _build()
    snaps = Snapshotter(root, run_id="test", local_world_size=local, node=node, background=background)
    losses = []
    for step in range(1, 5):
        losses.append(_step(model, optimizer, step))
        snaps.save(step, model, optimizer, extra={"step": step})
        snaps.record_progress(step)
    losses += [_step(model, optimizer, step) for step in (5, 6)]  # the uninterrupted run goes on
    snaps.close()
    dist.barrier()
    if dist.get_rank() == 0:
        if damage == "own area gone":
            shutil.rmtree(snapshot_area(root, node))
        elif damage:  # step 4 went to slot 0 (generation 4): its header at 4096, its payload from 8192
            with open(snapshot_area(root, node) / "rank-0.snap", "r+b") as f:
                f.seek(4096 * 2 + 100 if damage == "newest slot overwritten" else 4096)
                f.write(b"\xa5" * 64 if damage == "newest slot overwritten" else b"\0" * 8)
    dist.barrier()
    model, optimizer = _build(seed=1)  # other weights: the restore must overwrite them all
    snaps = Snapshotter(root, run_id="test", local_world_size=local, node=node)
    plan = snaps.newest(model)
    extra = snaps.restore(plan, model, optimizer)
    resumed = [_step(model, optimizer, step) for step in range(plan.step + 1, 7)]
    snaps.close(remove=True)
    return losses[plan.step:], resumed, (plan.step, plan.holders, plan.lost, extra)


@pytest.mark.parametrize("two_nodes, damage, background, step, holders", [
    (False, "", True, 4, [0, 1]),
    (True, "", False, 4, [0, 1]),
    (True, "own area gone", True, 4, [1, 1]),
    (False, "newest slot overwritten", False, 3, [0, 1]),
    (False, "newest header invalidated", True, 3, [0, 1]),  # killed after the save's first write
])
def test_restore_repeats_the_uninterrupted_steps(tmp_path, two_nodes, damage, background, step, holders):
    results = run_on_ranks(_train_snapshot_restore, 2, str(tmp_path), two_nodes, damage, background)
    for want, got, (restored, who, lost, extra) in results:
        assert (restored, who, lost, extra) == (step, holders, 4 - step, {"step": step})
        assert got == want  # bit for bit
    assert not any(tmp_path.rglob("*.snap"))  # close(remove=True) leaves nothing behind


def _close_without_waiting(root: str) -> tuple[int, list[int], bool]:
    """Two nodes, snapshots in the background. Step 1: both ranks save. Step 2: rank 0 saves and
    closes without waiting (a failing run) while rank 1 has not saved yet, so rank 0's peer copy
    is still in flight; only then does rank 1 save, and rank 0's thread receives rank 1's copy
    into the mapping its ``close`` kept. A fresh snapshotter on each rank restores step 2."""
    rank = dist.get_rank()
    model, optimizer = _build()
    snaps = Snapshotter(root, run_id="test", local_world_size=1, node=str(rank), background=True)
    for step in (1, 2):
        _step(model, optimizer, step)
        if step == 1 or rank == 0:
            snaps.save(step, model, optimizer, extra={"step": step})
    saved = [p.to_local().clone() for p in model.parameters()]
    if rank == 0:
        snaps.close(wait=False)  # returns with its peer's part outstanding (else the barrier never comes)
    dist.barrier()
    if rank == 1:
        snaps.save(2, model, optimizer, extra={"step": 2})
        snaps.close()
    else:
        for thread in threading.enumerate():
            if thread.name == "fsdp2-snapshot":
                thread.join()
    dist.barrier()
    fresh, fresh_optimizer = _build(seed=1)
    snaps = Snapshotter(root, run_id="test", local_world_size=1, node=str(rank))
    plan = snaps.newest(fresh)
    extra = snaps.restore(plan, fresh, fresh_optimizer)
    snaps.close(remove=True)
    same = all(torch.equal(a, p.to_local()) for a, p in zip(saved, fresh.parameters()))
    return plan.step, plan.holders, extra == {"step": 2} and same


def test_close_without_waiting_returns_and_keeps_the_files_mapped_for_the_save_in_flight(tmp_path):
    assert run_on_ranks(_close_without_waiting, 2, str(tmp_path)) == [(2, [0, 1], True)] * 2
    assert not any(tmp_path.rglob("*.snap"))


def _claim(root: str, run_id: str) -> str:
    try:
        Snapshotter(root, run_id=run_id, node="0").close()
    except SnapshotAreaError as e:
        return str(e)
    return ""


def _save_once(root: str) -> None:
    model, optimizer = _build()
    _step(model, optimizer, 1)
    snaps = Snapshotter(root, run_id="first", node="0")
    snaps.save(1, model, optimizer)
    snaps.close()


def test_an_area_in_use_or_of_another_run_is_refused(tmp_path):
    area = snapshot_area(tmp_path, "0")
    area.mkdir(parents=True)
    with open(area / "rank-1.snap", "w") as held:  # a live process of another run holds rank 1's file
        fcntl.flock(held, fcntl.LOCK_EX)
        said = run_on_ranks(_claim, 2, str(tmp_path), "second")
    assert said == [(f"snapshot area {area} is in use by another run (a live process holds the lock of "
                       "rank-1.snap): stop it or choose another checkpoint.snapshot_dir")] * 2  # every rank stops
    (area / "rank-1.snap").unlink()
    run_on_ranks(_save_once, 2, str(tmp_path))
    said = run_on_ranks(_claim, 2, str(tmp_path), "second")
    assert said == [f"snapshot area {area} holds another run's snapshots (run id first, this run's is second): "
                    f"remove it (rm -r {area}) or choose another checkpoint.snapshot_dir"] * 2
    assert run_on_ranks(_claim, 2, str(tmp_path), "first") == ["", ""]  # its own run resumes from them


def test_an_area_that_cannot_be_created_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    said = run_on_ranks(_claim, 2, str(tmp_path / "file"), "run")
    assert said[0].startswith(f"snapshot area {tmp_path / 'file' / 'node-0'} is not writable (")
    assert said[0].endswith("): choose another checkpoint.snapshot_dir")
