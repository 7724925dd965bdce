"""What an in-memory snapshot costs per step, against the step time, in one launch.

    torchrun --nproc-per-node 2 benchmarks/snapshot_cost.py --models demo,100M --rounds 5

For each model (``demo``: recipes/configs/tiny.toml, 0.80M parameters, 8 x 128 tokens per
rank; ``100M``: the same Llama with dim 1024, 9 layers, 105M parameters, 2 x 128 tokens per
rank), the recipe's model, AdamW and schedule are built and trained; after two warm-up steps
(and a first snapshot of each kind, which allocates and touches the slots), each round times
one training step alone, then, for each kind (one node: no peer copy; two simulated nodes:
each rank its own area, its snapshot also sent to the other rank over a gloo group and kept
there) and each mode (``sync``: the whole snapshot before the step goes on; ``background``:
only the copy, the checksum and the peer copy on the snapshotter's thread while the next
step trains), one snapshot followed by one training step and the wait for the snapshot's end.

Prints one JSON line per model, kind and mode: the median step time alone; what the snapshot
cost, the median over the rounds of (snapshot + step + wait) minus that round's step alone (both
the slowest rank's: what a run's step time grows by, overlap and interference included; a
difference of two noisy times, so small costs read as noise, even below 0); how long the
snapshot held the caller (``blocked_s``); the snapshot's parts (rank 0's medians: copy into the
slot, CRC-32, peer copy); the cost's ratio to the step; and the K ``--checkpoint.snapshot_every=auto``
would pick (it counts the whole snapshot's work, background included: cost / K at most 2% of
the step time). The transport of the peer copy is gloo over TCP on localhost.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp2.checkpoint import Snapshotter  # noqa: E402
from recipes.config import parse_args  # noqa: E402
from recipes.data import load_corpus  # noqa: E402
from recipes.llama.parallelize import ParallelDims  # noqa: E402
from recipes.pipeline import full_parameter_count  # noqa: E402
from recipes.snapshot import BUDGET  # noqa: E402
from recipes.build import build_model, build_optimizer, lr_schedule  # noqa: E402
from recipes.step import train_step  # noqa: E402

MODELS = {
    "demo": [],
    "100M": ["--model.dim=1024", "--model.n_layers=9", "--model.n_heads=16", "--model.n_kv_heads=8",
             "--training.batch_size=2"],
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="demo,100M", type=lambda s: s.split(","),
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--rounds", type=int, default=5, help="timed steps (and snapshots of each kind) per model")
    parser.add_argument("--dir", default="/dev/shm", help="where the snapshot areas go (a RAM file system)")
    return parser


def _slowest(*seconds: float) -> list[float]:
    """Each figure's maximum over the ranks."""
    figures = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return figures.tolist()


def measure(name: str, rounds: int, root: Path) -> list[dict]:
    config = parse_args([*MODELS[name], "--training.steps=1000"])
    dims = ParallelDims(1, -1, 1, dist.get_world_size())
    dims.build_mesh("cpu")
    model = build_model(config, dims, torch.device("cpu"))
    optimizer = build_optimizer(model, config.training)
    scheduler = lr_schedule(optimizer, config.training)
    corpus = load_corpus(None)
    rank = dist.get_rank()
    kinds = {"one node": Snapshotter(root / "one", run_id="bench", node="0"),
             "two nodes": Snapshotter(root / "two", run_id="bench", local_world_size=1, node=str(rank))}
    modes = {"sync": False, "background": True}
    step = 0

    def train() -> None:
        nonlocal step
        step += 1
        train_step(model, optimizer, scheduler, corpus, step, rank, config.training, torch.device("cpu"))

    for _ in range(2):
        train()
    for snaps in kinds.values():
        snaps.save(step, model, optimizer, extra={"step": step})
    steps: list[float] = []
    runs: dict[tuple[str, str], list[tuple[float, float, dict[str, float]]]] = {}
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        train()
        steps += _slowest(time.perf_counter() - start)
        alone = steps[-1]
        for kind, snaps in kinds.items():
            for mode, background in modes.items():
                snaps.background = background  # (no save in flight: each round waits for its own)
                dist.barrier()
                start = time.perf_counter()
                snaps.save(step, model, optimizer, extra={"step": step})
                saved = time.perf_counter()
                train()
                snaps.wait()
                blocked, total = _slowest(saved - start, time.perf_counter() - start)
                runs.setdefault((kind, mode), []).append((blocked, total - alone, snaps.last_cost))
    for snaps in kinds.values():
        snaps.close(remove=True)
    step_s = statistics.median(steps)
    rows = []
    for (kind, mode), got in runs.items():
        cost = statistics.median(grown for _, grown, _ in got)
        parts = {part: statistics.median(c[part] for _, _, c in got) for part in ("copy", "checksum", "peer")}
        work = sum(parts.values())
        rows.append({"model": name, "params": full_parameter_count(config)[0], "kind": kind, "mode": mode,
                     "world": dist.get_world_size(), "transport": "gloo (CPU, localhost)", "rounds": rounds,
                     "step_s": step_s, "snapshot_s": cost, "blocked_s": statistics.median(b for b, _, _ in got),
                     **{f"{p}_s": v for p, v in parts.items()}, "cost_per_step": cost / step_s,
                     "auto_every": max(1, math.ceil(work / (BUDGET * step_s)))})
    return rows


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    unknown = set(args.models) - set(MODELS)
    if unknown:
        raise SystemExit(f"unknown model {sorted(unknown)[0]}: use {', '.join(MODELS)}")
    dist.init_process_group("gloo")
    root = Path(tempfile.mkdtemp(prefix="fsdp2-snapshot-cost-", dir=args.dir)) if dist.get_rank() == 0 else None
    root_list = [str(root)]
    dist.broadcast_object_list(root_list)  # (a benchmark: the library itself never uses object collectives)
    root = Path(root_list[0])
    try:
        for name in args.models:
            for row in measure(name, args.rounds, root):
                if dist.get_rank() == 0:
                    print(json.dumps(row), flush=True)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    from recipes.exit import run_and_exit  # no interpreter finalization to abort a finished run

    run_and_exit(main)
