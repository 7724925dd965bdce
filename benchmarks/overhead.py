"""The runtime's own CPU time per training step, with communication taken out.

    python benchmarks/overhead.py                    # world 8, 32 groups
    python benchmarks/overhead.py --sweep            # worlds 8 and 64 x groups 8, 32 and 64
    python benchmarks/overhead.py --profile          # and where fsdp2's share goes, per function
    python benchmarks/overhead.py --plot overhead.png results.jsonl   # bars from saved lines (matplotlib)

What a GPU job feels of an FSDP runtime, beyond the collectives, is the Python work it adds
to every step on the host: hooks, copies in and out of the communication buffers, DTensor
construction. This measures that work alone. One process joins torch's fake process group
(``torch.testing._internal.distributed.fake_pg``) as rank 0 of ``--world`` ranks: every
collective returns at once, without moving data, so a step's time is computation plus the
runtime's own overhead. The same model is built three ways, each with its own
``AdamW(foreach=True)``:

- ``plain``:       the model itself, unsharded (the floor);
- ``fsdp2``:       ``fsdp2.fully_shard`` per block then the root, on the flat collectives NCCL
                   takes (``FSDP2_CPU_COLLECTIVES=flat``: the CPU exchange is not what a GPU
                   user runs);
- ``torch_fsdp2``: ``torch.distributed.fsdp.fully_shard``, applied the same way.

The model is ``--groups`` blocks of LayerNorm + Linear + GELU + Linear (``--dim`` wide), so
the per-group and per-parameter work dominates, as it does for small or latency-bound GPU
jobs. Steps (zero_grad, forward, sum, backward, optimizer step) are interleaved round-robin
with the starting implementation rotating, and a step's overhead is its time minus the plain
model's step in the same round; the median over ``--steps`` rounds after ``--warmup`` is
reported, as is ``fsdp2/torch_fsdp2``, the ratio of the two overheads. One JSON line per
configuration goes to stdout (and is appended to ``--out`` if given).

``--device cuda`` runs the same on one GPU (the fake process group still stands in for the
other ranks): a step is then timed until ``torch.cuda.synchronize()`` returns, ``host_ms`` is the
time until the step's Python returned (the work the host adds before the GPU can run ahead),
and ``peak_cuda_bytes`` is ``torch.cuda.max_memory_allocated`` over each implementation's steps
less what was allocated before them (``peak_cuda_total_bytes``: without the subtraction).

Note the optimizer: the sharded models step 1/world of the parameters, the plain model all
of them, so part of a sharded model's overhead is hidden by its cheaper optimizer step; it
is the same for both runtimes, and the ratio compares like with like.

The fake process group's collectives are not free on the host: its all-gather copies the
input into each of the ``world`` chunks of the output and its reduce-scatter cuts the input
into ``world`` views, so each call costs time in proportion to the world size (a real
backend's call enqueues one kernel or message, whatever the world). Both runtimes issue the
same collectives (per step 65 all-gathers and 33 reduce-scatters at 32 groups), so this adds
the same milliseconds to both overheads. Each call's host time is measured (the process
group's ``all_gather_single`` and ``reduce_scatter_single`` timed around the call, per step)
and reported as ``collectives_ms``; ``overhead_less_collectives_ms`` and the ratio
``less fake collectives`` take it out of each step before the median (``ratio`` keeps it in).
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import datetime
import gc
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator

os.environ.setdefault("FSDP2_CPU_COLLECTIVES", "flat")  # before fsdp2 builds any group

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

IMPLS = ("plain", "fsdp2", "torch_fsdp2")
CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, dim)
        self.down = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, dim: int, groups: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(groups))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(impl: str, dim: int, groups: int, world: int,
          device: torch.device = CPU) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Model(dim, groups).to(device)
    if impl != "plain":
        if impl == "fsdp2":
            from fsdp2 import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optim.zero_grad(set_to_none=True)
    model(x).sum().backward()
    optim.step()


class CollectiveClock:
    """Host time spent inside the process group's flat collectives since ``reset``: both
    runtimes reach the fake process group through ``ProcessGroup.all_gather_single`` and
    ``ProcessGroup.reduce_scatter_single``, timed here around each call."""

    NAMES = ("all_gather_single", "reduce_scatter_single")

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.seconds = 0.0
        self.calls = 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[CollectiveClock]:
        cls = dist.ProcessGroup
        originals = {name: getattr(cls, name) for name in self.NAMES if hasattr(cls, name)}

        def timed(original):
            def call(*args, **kwargs):
                start = self.clock()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.seconds += self.clock() - start
                    self.calls += 1
            return call

        for name, original in originals.items():
            setattr(cls, name, timed(original))
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(cls, name, original)


@contextlib.contextmanager
def fake_world(world: int) -> Iterator[None]:
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore(),
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def measure(world: int, groups: int, dim: int, batch: int, steps: int, warmup: int,
            profile: bool, device: torch.device = CPU) -> dict:
    cuda = device.type == "cuda"
    x = torch.randn(batch, dim, generator=torch.Generator().manual_seed(1)).to(device)
    clock = CollectiveClock()
    with fake_world(world), clock.installed():
        built = {impl: build(impl, dim, groups, world, device) for impl in IMPLS}
        times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
        host: dict[str, list[float]] = {impl: [] for impl in IMPLS}
        comm: dict[str, list[float]] = {impl: [] for impl in IMPLS}  # host time in the fake collectives
        calls: dict[str, int] = dict.fromkeys(IMPLS, 0)
        peak = dict.fromkeys(IMPLS, 0)
        peak_total = dict.fromkeys(IMPLS, 0)
        gc.collect()
        gc.disable()  # a collection landing in one implementation's step is noise
        try:
            for r in range(warmup + steps):
                order = IMPLS[r % len(IMPLS):] + IMPLS[:r % len(IMPLS)]
                for impl in order:
                    if cuda:
                        torch.cuda.synchronize(device)
                        before = torch.cuda.memory_allocated(device)
                        torch.cuda.reset_peak_memory_stats(device)
                    clock.reset()
                    start = time.perf_counter()
                    step(*built[impl], x)
                    returned = time.perf_counter()
                    if cuda:
                        torch.cuda.synchronize(device)
                        total = torch.cuda.max_memory_allocated(device)
                        peak[impl] = max(peak[impl], total - before)
                        peak_total[impl] = max(peak_total[impl], total)
                    if r >= warmup:
                        times[impl].append(time.perf_counter() - start)
                        host[impl].append(returned - start)
                        comm[impl].append(clock.seconds)
                        calls[impl] = clock.calls
        finally:
            gc.enable()
        top = profile_fsdp2(*built["fsdp2"], x, steps) if profile else None
    overhead = {impl: statistics.median(t - p for t, p in zip(times[impl], times["plain"]))
                for impl in IMPLS[1:]}
    less = {impl: statistics.median(t - c - p for t, c, p in zip(times[impl], comm[impl], times["plain"]))
            for impl in IMPLS[1:]}
    result = {
        "config": {"world": world, "groups": groups, "dim": dim, "batch": batch, "steps": steps,
                   "warmup": warmup, "params": sum(p.numel() for p in Model(dim, groups).parameters()),
                   "transport": "flat (fake process group)", "device": device.type, "torch": torch.__version__},
        "median_step_ms": {impl: round(1e3 * statistics.median(times[impl]), 3) for impl in IMPLS},
        "overhead_ms": {impl: round(1e3 * v, 3) for impl, v in overhead.items()},
        "ratio": {"fsdp2/torch_fsdp2": round(overhead["fsdp2"] / overhead["torch_fsdp2"], 3)
                  if overhead["torch_fsdp2"] > 0 else None,
                  "less fake collectives": round(less["fsdp2"] / less["torch_fsdp2"], 3)
                  if less["torch_fsdp2"] > 0 else None},
        "collectives_ms": {impl: round(1e3 * statistics.median(comm[impl]), 3) for impl in IMPLS[1:]},
        "collective_calls_per_step": {impl: calls[impl] for impl in IMPLS[1:]},
        "overhead_less_collectives_ms": {impl: round(1e3 * v, 3) for impl, v in less.items()},
    }
    if cuda:
        result["config"]["gpu"] = torch.cuda.get_device_name(device)
        result["host_ms"] = {impl: round(1e3 * statistics.median(host[impl]), 3) for impl in IMPLS}
        result["peak_cuda_bytes"] = peak
        result["peak_cuda_total_bytes"] = peak_total
        if peak["torch_fsdp2"] > 0:
            result["ratio"]["peak fsdp2/torch_fsdp2"] = round(peak["fsdp2"] / peak["torch_fsdp2"], 3)
    if top is not None:
        result["fsdp2_profile_ms_per_step"] = top
    return result


def profile_fsdp2(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, steps: int) -> list:
    """fsdp2's own functions by time spent in them (excluding callees) per step, largest first."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step(model, optim, x)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, ncalls, tottime, cumtime, callers)
    rows = []
    for (file, line, name), (_calls, ncalls, tottime, cumtime, _callers) in stats.items():
        if f"{os.sep}fsdp2{os.sep}" in file:
            where = f"{file.split(os.sep + 'fsdp2' + os.sep, 1)[1]}:{line} {name}"
            rows.append([where, round(ncalls / steps, 1), round(1e3 * tottime / steps, 3),
                         round(1e3 * cumtime / steps, 3)])
    rows.sort(key=lambda r: -r[2])
    return [["function", "calls/step", "own ms/step", "cumulative ms/step"], *rows[:25]]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=8, help="ranks the fake process group pretends to have")
    parser.add_argument("--groups", type=int, default=32, help="blocks, each one fully_shard group")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30, help="timed rounds (one step of each model per round)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="worlds 8 and 64 x groups 8, 32 and 64")
    parser.add_argument("--profile", action="store_true", help="add fsdp2's own functions, by time per step")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the models on this process's GPU (the fake process group still moves no data)")
    parser.add_argument("--out", help="append the JSON lines to this file too")
    parser.add_argument("--plot", metavar="PNG", help="draw the lines of the given files instead of measuring")
    parser.add_argument("files", nargs="*", help="with --plot: JSON lines written by --out")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot:
        return plot([json.loads(line) for path in args.files for line in open(path) if line.strip()], args.plot)
    torch.set_num_threads(1)  # the overhead is single-threaded host work; keep compute comparable
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--device cuda: CUDA is not available here (torch {torch.__version__})")
        device = torch.device("cuda", torch.cuda.current_device())
    configs = [(w, g) for w in (8, 64) for g in (8, 32, 64)] if args.sweep else [(args.world, args.groups)]
    for world, groups in configs:
        result = measure(world, groups, args.dim, args.batch, args.steps, args.warmup, args.profile, device)
        line = json.dumps(result)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


def plot(results: list[dict], path: str) -> None:
    """Per (world, groups): the median overhead of fsdp2 and torch's FSDP2, in ms per step, one
    bar per launch, labelled with the launch's ratio. Needs matplotlib (the ``plot`` extra)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = sorted(results, key=lambda r: (r["config"]["world"], r["config"]["groups"]))
    labels = [f"world {r['config']['world']}\n{r['config']['groups']} groups" for r in results]
    xs = range(len(results))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(results)), 4.0))
    for shift, impl, color in ((-0.2, "torch_fsdp2", "tab:orange"), (0.2, "fsdp2", "tab:blue")):
        ax.bar([x + shift for x in xs], [r["overhead_ms"][impl] for r in results], width=0.4, color=color,
               label=impl.replace("_", " "))
    for x, r in zip(xs, results):
        ax.annotate(f"{r['ratio']['fsdp2/torch_fsdp2']:.2f}", (x + 0.2, r["overhead_ms"]["fsdp2"]),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("runtime overhead per step (ms)")
    ax.set_title("CPU time the runtime adds to a step (fake process group, flat collectives)\n"
                 "labels: fsdp2 / torch FSDP2", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/, next to benchmarks/
    from recipes.exit import run_and_exit  # no interpreter finalization to abort a finished run

    run_and_exit(main)
