"""Where a step's host time goes, fsdp2 against torch's FSDP2, on the CPU and on a GPU.

    python benchmarks/host_profile.py --device cpu                  # this machine
    python benchmarks/host_profile.py --device cpu,cuda --out p.json  # a GPU machine: both, one launch

``overhead.py`` measures the runtime's host time per step (fake process group, world 8, 32
groups); on the CPU fsdp2's is about half of torch FSDP2's, on an H100/H200 about three
quarters. This script says why, by counting rather than timing alone. For each device and each
implementation (``plain``, ``fsdp2``, ``torch_fsdp2``, built as ``overhead.py`` builds them) it
records, per step:

- ``host_ms``: the median time until the step's Python returned (no synchronisation);
- ``aten_ops``: the ATen operators dispatched (every ``aten::`` event of ``torch.profiler``,
  nested ones included), and the twenty with the most self CPU time;
- ``cuda_api``: the CUDA runtime calls (kernel launches, copies, event records, stream waits)
  and ``kernels``: the kernels the GPU ran;
- ``python``: cProfile's twenty functions with the most own time, torch's and fsdp2's alike.

``op_cost_us`` times a few single operators on small tensors per device, to turn counts into
time. The JSON (one object) goes to stdout and to ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead  # noqa: E402  (sets FSDP2_CPU_COLLECTIVES=flat before fsdp2 is imported)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

IMPLS = overhead.IMPLS
TOP = 20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_times(model, optim, x, device, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        overhead.step(model, optim, x)
        times.append(time.perf_counter() - start)
    sync(device)
    return times


def op_counts(model, optim, x, device, steps: int) -> dict:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            overhead.step(model, optim, x)
        sync(device)
    aten, cuda_api, kernels = collections.Counter(), collections.Counter(), 0
    self_us: dict[str, float] = collections.defaultdict(float)
    for evt in prof.events():
        name = evt.name
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
        elif name.startswith("aten::"):
            aten[name] += 1
            self_us[name] += evt.self_cpu_time_total
        elif name.startswith("cuda") or name.startswith("cu"):
            cuda_api[name] += 1
    per = 1.0 / steps
    return {
        "aten_ops": round(sum(aten.values()) * per, 1),
        "aten_top_self_us": [[n, round(aten[n] * per, 1), round(self_us[n] * per, 1)]
                             for n in sorted(self_us, key=lambda n: -self_us[n])[:TOP]],
        "aten_counts": {n: round(c * per, 1) for n, c in aten.most_common()},
        "cuda_api": {n: round(c * per, 1) for n, c in cuda_api.most_common()},
        "cuda_api_total": round(sum(cuda_api.values()) * per, 1),
        "kernels": round(kernels * per, 1),
    }


def python_top(model, optim, x, device, steps: int) -> list:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        overhead.step(model, optim, x)
    sync(device)
    profiler.disable()
    rows = []
    for (file, line, name), (_c, ncalls, tottime, cumtime, _callers) in pstats.Stats(profiler).stats.items():
        short = "/".join(file.split(os.sep)[-3:])
        rows.append([f"{short}:{line} {name}", round(ncalls / steps, 1), round(1e3 * tottime / steps, 3),
                     round(1e3 * cumtime / steps, 3)])
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    return [["total own ms/step", round(total, 3)], ["function", "calls/step", "own ms", "cum ms"], *rows[:TOP]]


def op_cost(device: torch.device, reps: int = 2000) -> dict:
    """Host microseconds per call of a few ops on small tensors."""
    a = torch.randn(64, 64, device=device)
    b = torch.empty_like(a)
    flat = torch.empty(64 * 64 * 8, device=device)
    ops = {
        "add_": lambda: a.add_(0.0),
        "copy_": lambda: b.copy_(a),
        "empty": lambda: torch.empty(4096, device=device),
        "view+narrow": lambda: flat.narrow(0, 4096, 4096).view(64, 64),
        "mm": lambda: torch.mm(a, a),
        "foreach_copy_x8": lambda: torch._foreach_copy_([b] * 8, [a] * 8),
    }
    out = {}
    for name, fn in ops.items():
        for _ in range(50):
            fn()
        sync(device)
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        out[name] = round(1e6 * (time.perf_counter() - start) / reps, 2)
        sync(device)
    return out


def measure(device: torch.device, world: int, groups: int, dim: int, batch: int, steps: int) -> dict:
    x = torch.randn(batch, dim, generator=torch.Generator().manual_seed(1)).to(device)
    result: dict = {"device": device.type, "op_cost_us": op_cost(device), "impls": {}}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    with overhead.fake_world(world):
        built = {impl: overhead.build(impl, dim, groups, world, device) for impl in IMPLS}
        for impl in IMPLS:
            host_times(*built[impl], x, device, 5)  # warm-up
        for impl in IMPLS:
            times = host_times(*built[impl], x, device, steps)
            entry = {"host_ms": round(1e3 * statistics.median(times), 3)}
            entry.update(op_counts(*built[impl], x, device, 3))
            entry["python"] = python_top(*built[impl], x, device, 5)
            result["impls"][impl] = entry
    base = result["impls"]["plain"]["host_ms"]
    ours, theirs = (result["impls"][i]["host_ms"] - base for i in IMPLS[1:])
    result["overhead_ratio"] = round(ours / theirs, 3) if theirs > 0 else None
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="comma-separated: cpu, cuda")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {"config": vars(args) | {"torch": torch.__version__}, "devices": []}
    for name in args.device.split(","):
        device = torch.device(name)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                parser.error("--device cuda: CUDA is not available here")
            device = torch.device("cuda", torch.cuda.current_device())
        results["devices"].append(measure(device, args.world, args.groups, args.dim, args.batch, args.steps))
    text = json.dumps(results)
    print(text)
    for entry in results["devices"]:
        print(f"{entry['device']}: overhead fsdp2/torch_fsdp2 {entry['overhead_ratio']}", file=sys.stderr)
        for impl, row in entry["impls"].items():
            print(f"  {impl:12s} host {row['host_ms']:8.2f} ms/step, {row['aten_ops']:7.0f} aten ops, "
                  f"{row['aten_counts'].get('aten::copy_', 0):6.0f} copy_, {row['kernels']:6.0f} kernels, "
                  f"{row['cuda_api_total']:6.0f} CUDA API calls", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
