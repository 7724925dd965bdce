"""Peak live bytes of one training step per rank, by torch's own ``MemTracker``: fsdp2 against torch.

    torchrun --nproc-per-node 2 benchmarks/peak_memory.py [--launches 3] [--json FILE]

The model is ``step_time.py``'s 17M GPT (its ``--dim .. --batch`` options too), sharded
per block and then the root, trained with AdamW on 2 gloo ranks. Six implementations,
each in a fresh model and optimizer:

- ``fsdp2_flat``:    ``fsdp2.fully_shard`` with ``FSDP2_CPU_COLLECTIVES=flat`` (the flat
                     collectives NCCL uses, run on gloo);
- ``fsdp2``:         ``fsdp2.fully_shard`` with the default CPU transport;
- ``fsdp2_flat_early``, ``fsdp2_early``: the same with ``set_early_release(True)`` on the
                     root (its parameters freed a part at a time: opt-in, see its limits);
- ``torch_fsdp2``:   ``torch.distributed.fsdp.fully_shard``;
- ``ddp``:           ``DistributedDataParallel``.

Each takes one untracked step (so AdamW's state exists, as in every later step), then one
step (zero_grad, forward, backward, ``optimizer.step()``) under
``torch.distributed._tools.mem_tracker.MemTracker``, torch's generic tracker of live tensor
storages, which counts the same way for every implementation. The peak is rank 0's (the
ranks hold the same bytes up to padding). For the fsdp2 implementations, fsdp2's own
``MemoryTracker`` then tracks the same step again for a breakdown of what is alive at its
peak (parameters, gradients, optimizer state, unsharded parameters, communication buffers,
activations). Memory is deterministic: the numbers do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from step_time import GPT, PRESETS, make_batch, shard_model, train_step  # noqa: E402

IMPLS = ("fsdp2_flat", "fsdp2", "fsdp2_flat_early", "fsdp2_early", "torch_fsdp2", "ddp")
TARGETS = {"fsdp2_flat": 1.00, "fsdp2": 0.95}  # x torch_fsdp2's peak (issue 18)
MB = 1e6


def wrap(impl: str, model: GPT, mesh) -> torch.nn.Module:
    if impl in ("fsdp2_flat", "fsdp2", "fsdp2_flat_early", "fsdp2_early"):
        import fsdp2
        before = os.environ.get("FSDP2_CPU_COLLECTIVES")
        os.environ["FSDP2_CPU_COLLECTIVES"] = "flat" if impl.startswith("fsdp2_flat") else "auto"
        try:  # read when each group is built
            sharded = shard_model(model, mesh, fsdp2.fully_shard)
            sharded.set_early_release(impl.endswith("_early"))
            return sharded
        finally:
            if before is None:
                del os.environ["FSDP2_CPU_COLLECTIVES"]
            else:
                os.environ["FSDP2_CPU_COLLECTIVES"] = before
    if impl == "torch_fsdp2":
        from torch.distributed.fsdp import fully_shard
        return shard_model(model, mesh, fully_shard)
    if impl == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(IMPLS)}")


def measure(impl: str, base: GPT, mesh, cfg) -> dict:
    """One untracked step, then one under MemTracker (and fsdp2's MemoryTracker for fsdp2)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    rank = dist.get_rank()
    model = wrap(impl, copy.deepcopy(base), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, opt, *make_batch(rank, 0, cfg, torch.device("cpu")))
    inputs, targets = make_batch(rank, 1, cfg, torch.device("cpu"))
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        train_step(model, opt, inputs, targets)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    result = {"peak_bytes": int(peak)}
    if impl.startswith("fsdp2"):
        import fsdp2
        inputs, targets = make_batch(rank, 2, cfg, torch.device("cpu"))
        with fsdp2.MemoryTracker(model, opt) as ours:
            train_step(model, opt, inputs, targets)
        report = ours.report
        result.update(ours_peak_bytes=report.peak_bytes, peak_phase=report.peak_phase,
                      peak_by_category=report.peak_by_category, peak_by_group=report.peak_by_group)
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = PRESETS["17M"]
    for name in ("dim", "layers", "heads", "vocab", "seq", "batch"):
        p.add_argument(f"--{name}", type=int, default=getattr(d, name))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--launches", type=int, default=1, help="repeat the whole measurement (fresh models)")
    p.add_argument("--json", default=None, help="append one JSON line per launch to this file")
    return p


def main() -> None:
    args = build_parser().parse_args()
    cfg = type(PRESETS["17M"])(args.dim, args.layers, args.heads, args.vocab, args.seq, args.batch)
    impls = [i for i in args.impls.split(",") if i]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    try:
        for launch in range(args.launches):
            torch.manual_seed(0)
            base = GPT(cfg.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.seq)
            results = {impl: measure(impl, base, mesh, cfg) for impl in impls}
            if dist.get_rank() != 0:
                continue
            ref = results.get("torch_fsdp2", {}).get("peak_bytes")
            line = {"launch": launch, "config": cfg.__dict__, "world": dist.get_world_size(),
                    "peak_bytes": {i: r["peak_bytes"] for i, r in results.items()},
                    "peak_mb": {i: round(r["peak_bytes"] / MB, 1) for i, r in results.items()},
                    "ratio_to_torch_fsdp2": ({i: round(r["peak_bytes"] / ref, 4) for i, r in results.items()}
                                             if ref else {}),
                    "target_met": {i: results[i]["peak_bytes"] <= t * ref for i, t in TARGETS.items()
                                   if i in results and ref},
                    "targets": TARGETS,
                    "fsdp2_breakdown_mb": {i: {"phase": r["peak_phase"],
                                               "ours_peak": round(r["ours_peak_bytes"] / MB, 1),
                                               **{k: round(v / MB, 1) for k, v in r["peak_by_category"].items()},
                                               "groups": r["peak_by_group"]}
                                           for i, r in results.items() if "peak_phase" in r}}
            print(json.dumps(line), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(line) + "\n")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from recipes.exit import run_and_exit  # no interpreter finalization to abort a finished run

    run_and_exit(main)
