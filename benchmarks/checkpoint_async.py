"""What a checkpoint costs training, synchronous against async, and how close saves and loads come to the disk.

Run under torchrun on 2 ranks (gloo, CPU), one launch for every figure::

    torchrun --standalone --nproc-per-node 2 benchmarks/checkpoint_async.py --params 100000000 --saves 3

A stack of 8 square ``nn.Linear`` layers (``--params`` fp32 parameters), each layer and the
root ``fsdp2.fully_shard``-ed, trained with AdamW (so a checkpoint holds about 3 x 4 bytes x
params). One ``fsdp2.checkpoint.AsyncSaver`` per mode (``off``, ``async``, ``pinned``); the
modes take turns, ``--saves`` rounds. Each save follows a training step and is followed by
``--steps-between`` steps, then the saver's ``wait``:

- ``blocked_s``: how long the save call kept training (``off``: the whole save; async: the
  staging copy into buffers kept from the saver's first save, whose allocation is reported
  apart as ``first_blocked_s``: round 0 is that first save). ``wait_after_s``: how long the
  ``wait`` after the steps still took (the part of the write the steps did not cover: a run
  saving every that many steps waits as long at its next save). Medians over the rounds.
- ``step_s`` / ``step_during_write_s``: the median step with no write running, and of the
  steps taken while an async write ran (both ranks share the machine's cores with the write).
- Disk: each rank copies its data file of the checkpoint just saved (the same bytes, read from
  the page cache) to a new file at the same time and fsyncs it (``disk_write_mib_s``: the bytes
  of both over the slower rank's time), then drops it from the page cache
  (``posix_fadvise(DONTNEED)``) and reads it back (``disk_read_mib_s``).
  ``save_of_disk``: the synchronous ``fsdp2.checkpoint.save``'s throughput (checkpoint bytes over its time, marker
  and checksums included) as a fraction of that write speed; ``load_of_disk``:
  ``fsdp2.checkpoint.load`` of a checkpoint dropped from the page cache the same way, without
  and with the content check (which reads every file once more), as a fraction of the read speed.
  These run ``--repeats`` times, interleaved (save, disk, loads); each figure is the median, and
  ``*_each`` lists each repeat's own ratio.

Rank 0 prints one JSON line. ``--dir`` is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2.checkpoint as ckpt
from fsdp2 import fully_shard

MODES = ("off", "async", "pinned")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000_000, help="fp32 parameters of the model")
    parser.add_argument("--saves", type=int, default=3, help="rounds: one save per mode each")
    parser.add_argument("--steps-between", type=int, default=2, help="training steps after each save")
    parser.add_argument("--repeats", type=int, default=5, help="synchronous save, disk and loads: median of")
    parser.add_argument("--batch", type=int, default=8, help="rows per step and rank")
    parser.add_argument("--dir", default="/tmp/fsdp2-async-bench", help="where to write (removed at the end)")
    return parser


def _model(params: int) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    width = int((params / 8) ** 0.5)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(8)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), width


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, width: int, batch: int) -> float:
    start = time.perf_counter()
    model(torch.randn(batch, width)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    dist.barrier()
    return time.perf_counter() - start


def _drop_cache(path: Path) -> None:
    """Evict ``path``'s (or every file under it) clean pages from the page cache."""
    for file in [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _disk(root: Path, source: Path) -> tuple[float, float]:
    """(write, read) MiB/s of all ranks at once copying ``source`` (their data file of the checkpoint
    just saved, still in the page cache) to a new file with fsync, then reading it back, cache dropped."""
    file = root / f"disk-{dist.get_rank()}.bin"
    block = bytearray(8 * 2**20)
    dist.barrier()
    start = time.perf_counter()
    with open(source, "rb", buffering=0) as src, open(file, "wb", buffering=0) as f, memoryview(block) as view:
        while n := src.readinto(view):
            f.write(view[:n])
        os.fsync(f.fileno())
    write = _slowest(time.perf_counter() - start)
    _drop_cache(file)
    dist.barrier()
    start = time.perf_counter()
    with open(file, "rb", buffering=0) as f:
        while f.read(8 * 2**20):
            pass
    read = _slowest(time.perf_counter() - start)
    total = file.stat().st_size * dist.get_world_size() / 2**20
    file.unlink()
    return total / write, total / read


def _rounds(args, model, optimizer, width, root: Path) -> dict:
    savers = {mode: ckpt.AsyncSaver(mode) for mode in MODES}
    blocked: dict[str, list[float]] = {m: [] for m in MODES}
    after: dict[str, list[float]] = {m: [] for m in MODES}
    quiet, during = [], []
    for r in range(args.saves + 1):  # round 0: each saver's first save, which allocates its buffers
        for mode in MODES[r % 3:] + MODES[:r % 3]:  # a different mode first each round
            quiet.append(_step(model, optimizer, width, args.batch))
            path = root / f"{mode}-{r}"
            start = time.perf_counter()
            savers[mode].save(path, model, optimizer, extra={"round": r})
            blocked[mode].append(_slowest(time.perf_counter() - start))
            steps = [_step(model, optimizer, width, args.batch) for _ in range(args.steps_between)]
            (during if mode != "off" else quiet).extend(steps)
            start = time.perf_counter()
            savers[mode].wait()
            after[mode].append(_slowest(time.perf_counter() - start))
            if dist.get_rank() == 0 and r:
                shutil.rmtree(root / f"{mode}-{r - 1}")
    for saver in savers.values():
        saver.close()
    first = {m: round(v.pop(0), 3) for m, v in blocked.items()}
    for v in after.values():
        v.pop(0)
    median = statistics.median
    return {"first_blocked_s": first, "blocked_s": {m: round(median(v), 3) for m, v in blocked.items()},
            "wait_after_s": {m: round(median(v), 3) for m, v in after.items()},
            "async_of_off": round(median(blocked["async"]) / median(blocked["off"]), 3),
            "pinned_of_off": round(median(blocked["pinned"]) / median(blocked["off"]), 3),
            "step_s": round(median(quiet), 3), "step_during_write_s": round(median(during), 3)}


def _load_times(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    out = {}
    for name, check in (("load_unchecked_s", False), ("load_checked_s", True)):
        _drop_cache(path)  # every rank drops every file (shared filesystem: same pages)
        dist.barrier()
        start = time.perf_counter()
        ckpt.load(path, model, optimizer, check_content=check)
        out[name] = _slowest(time.perf_counter() - start)
    return out


def main() -> None:
    args = build_parser().parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    root = Path(args.dir)
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    dist.barrier()
    model, optimizer, width = _model(args.params)
    _step(model, optimizer, width, args.batch)  # AdamW's state exists from here on
    result = _rounds(args, model, optimizer, width, root)
    # The synchronous save's throughput and the loads, against the disk measured right here,
    # interleaved, --repeats times (medians: the disk is shared with other jobs).
    sync, runs = root / "sync", []
    for _ in range(args.repeats):
        if dist.get_rank() == 0:
            shutil.rmtree(sync, ignore_errors=True)
        dist.barrier()
        start = time.perf_counter()
        ckpt.save(sync, model, optimizer)
        save_s = _slowest(time.perf_counter() - start)
        size = sum(f.stat().st_size for f in sync.iterdir() if f.is_file())
        write, read = _disk(root, sync / f"__{dist.get_rank()}_0.distcp")
        runs.append({"save_s": save_s, "write": write, "read": read, **_load_times(sync, model, optimizer)})
    save_s, write, read = (statistics.median(r[k] for r in runs) for k in ("save_s", "write", "read"))
    loads = {k: statistics.median(r[k] for r in runs) for k in ("load_unchecked_s", "load_checked_s")}
    mib = size / 2**20
    params = sum(p.numel() for p in model.parameters())
    if dist.get_rank() == 0:
        print(json.dumps({
            "params": params, "ranks": dist.get_world_size(), "transport": "gloo (CPU)", "torch": torch.__version__,
            "checkpoint_mib": round(mib, 1), "saves_per_mode": args.saves, "steps_between": args.steps_between,
            "repeats": args.repeats,
            **result, "save_s": round(save_s, 3), "disk_write_mib_s": round(write, 1),
            "disk_read_mib_s": round(read, 1),
            "save_mib_s": round(mib / save_s, 1), "save_of_disk": round(mib / save_s / write, 3),
            **{k: round(v, 3) for k, v in loads.items()},
            "load_unchecked_of_disk": round(mib / loads["load_unchecked_s"] / read, 3),
            "load_checked_of_disk": round(mib / loads["load_checked_s"] / read, 3),
            # Each repeat's own ratios: the disk's speed moves between back-to-back measurements.
            "save_of_disk_each": [round(mib / r["save_s"] / r["write"], 3) for r in runs],
            "load_unchecked_of_disk_each": [round(mib / r["load_unchecked_s"] / r["read"], 3) for r in runs]}))
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/, next to benchmarks/
    from recipes.exit import run_and_exit  # no interpreter finalization to abort a finished run

    run_and_exit(main)
