"""The step-time model (``fsdp2.plan.predict_step_time``) against measured steps of the recipe.

    python benchmarks/plan_accuracy.py                 # 14 layouts on 2 and 4 CPU ranks, 2 rounds (~10 min)
    python benchmarks/plan_accuracy.py --quick         # 2 layouts, 3 steps, 1 round: the pipeline runs end to end
    python benchmarks/plan_accuracy.py --out rows.jsonl --steps 8 --warmup 2 --rounds 3
    python benchmarks/plan_accuracy.py --device cuda --hardware h200   # 8 bf16 ~1B layouts, one GPU

It calibrates this machine before each round (``fsdp2.plan.calibrate``: one profile per world
size, its ranks spawned as training spawns them, so they share the cores as training's do; the
prediction uses the rounds' mean), and launches
``recipes/train.py`` under torchrun (``--standalone``, gloo on CPU) ``--rounds`` times per layout
of a small Llama (the tiny config's model at dim 256: FSDP, HSDP, TP, PP 1F1B, activation
checkpointing, reshard after forward on and off, two micro-batch sizes, on 2 and 4 ranks), the
rounds in alternating order, reads each step's tokens/s from the recipe's metrics file and takes
the median of the layout's steps after ``--warmup`` in each launch. A failed launch is retried
once and reported in the JSON line (``failed_launches``). Each layout's prediction comes from the
same command line: the recipe's config is turned into the planner's flags
(``recipes.preflight.plan_argv``), then a ``Layout``, ``model_costs`` and ``predict_step_time``
on the calibrated profile.

It prints a table (layout, predicted s, measured s, error) and ends with one JSON line:
``spearman`` (rank correlation of predicted and measured step times), ``median_abs_error`` (a
fraction), ``best_gap`` (the layout the model ranks first, as the search ranks: by time per token
per rank; its measured time per token per rank over the least measured, minus 1; ``best_gap_step``
the same on raw step times), the transport, torch version, world sizes, the profiles and the
per-layout rows.
Issue #39's targets: spearman >= 0.9, median_abs_error <= 0.15, best_gap <= 0.05.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # recipes/ next to fsdp2/

from fsdp2.plan import _cli  # noqa: E402
from fsdp2.plan import Hardware, ModelBuilder, calibrate, load_hardware, model_costs, predict_step_time  # noqa: E402
from recipes.preflight import plan_argv  # noqa: E402
from recipes.checks import check_command  # noqa: E402

# The model: the tiny config's Llama (4 layers, 4 heads, 2 kv heads, vocab 256) at dim 256, seq 128,
# large enough that its matmuls are not negligible beside the per-op overheads.
MODEL = ["--model.dim=256", "--model.n_layers=4", "--training.seq_len=128"]

# (name, ranks, recipe flags)
LAYOUTS: list[tuple[str, int, list[str]]] = [
    ("fsdp b4", 2, ["--training.batch_size=4"]),
    ("fsdp b8", 2, ["--training.batch_size=8"]),
    ("fsdp b4 ac", 2, ["--training.batch_size=4", "--training.activation_checkpoint=true"]),
    ("fsdp b4 no-reshard", 2, ["--training.batch_size=4", "--parallelism.reshard_after_forward=never"]),
    ("tp2 b4", 2, ["--training.batch_size=4", "--tp", "2"]),
    ("pp2 1f1b b4", 2, ["--training.batch_size=4", "--parallelism.pp=2", "--parallelism.pp_schedule=1F1B"]),
    ("pp2 1f1b b8", 2, ["--training.batch_size=8", "--parallelism.pp=2", "--parallelism.pp_schedule=1F1B"]),
    ("fsdp b2", 4, ["--training.batch_size=2"]),
    ("fsdp b4", 4, ["--training.batch_size=4"]),
    ("fsdp b4 ac", 4, ["--training.batch_size=4", "--training.activation_checkpoint=true"]),
    ("fsdp b4 no-reshard", 4, ["--training.batch_size=4", "--parallelism.reshard_after_forward=never"]),
    ("hsdp 2x2 b4", 4, ["--training.batch_size=4", "--dp-replicate", "2"]),
    ("fsdp2 x tp2 b4", 4, ["--training.batch_size=4", "--tp", "2"]),
    ("pp2 x fsdp2 b4", 4, ["--training.batch_size=4", "--parallelism.pp=2", "--parallelism.pp_schedule=1F1B"]),
]
QUICK = [LAYOUTS[0], LAYOUTS[4]]

# --device cuda: one rank on one GPU, bf16, Llamas of ~1B parameters at seq 2048 (the sizes where
# a GPU's matmuls, not the host, should set the pace; the smallest batch shows where they do not).
# What these check is the compute side of the model with a GPU preset (--hardware): matmuls,
# attention, elementwise ops, recomputation, the optimizer; one rank has no collectives to time.
_WIDE = ["--model.dim=2048", "--model.n_layers=16", "--model.n_heads=16", "--model.n_kv_heads=8"]
_DEEP = ["--model.dim=4096", "--model.n_layers=4", "--model.n_heads=32", "--model.n_kv_heads=8"]
_GPU = ["--model.vocab_size=32768", "--model.max_seq_len=2048", "--training.seq_len=2048",
        "--training.mixed_precision=bf16"]
GPU_LAYOUTS: list[tuple[str, int, list[str]]] = [
    ("2048x16 b1", 1, [*_GPU, *_WIDE, "--training.batch_size=1"]),
    ("2048x16 b2", 1, [*_GPU, *_WIDE, "--training.batch_size=2"]),
    ("2048x16 b4", 1, [*_GPU, *_WIDE, "--training.batch_size=4"]),
    ("2048x16 b4 ac", 1, [*_GPU, *_WIDE, "--training.batch_size=4", "--training.activation_checkpoint=true"]),
    ("2048x16 b8 ac", 1, [*_GPU, *_WIDE, "--training.batch_size=8", "--training.activation_checkpoint=true"]),
    ("4096x4 b1", 1, [*_GPU, *_DEEP, "--training.batch_size=1"]),
    ("4096x4 b2", 1, [*_GPU, *_DEEP, "--training.batch_size=2"]),
    ("4096x4 b4 ac", 1, [*_GPU, *_DEEP, "--training.batch_size=4", "--training.activation_checkpoint=true"]),
]
# --device cuda --quick, or the GPU layouts' pipeline checked on CPU (--device cpu --gpu-layouts):
# the same flags at toy size.
_TOY_GPU = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
            "--model.vocab_size=512", "--model.max_seq_len=64", "--training.seq_len=64"]


def recipe_argv(flags: list[str], steps: int) -> list[str]:
    model = [] if any(f.startswith("--model.dim=") for f in flags) else MODEL
    # (no loss curve: its PNG would go with the launch's temporary directory, after matplotlib's import)
    return [*model, *flags, "--steps", str(steps), "--metrics.log_every=1", "--metrics.sample_tokens=0",
            "--metrics.plot=false", "--training.warmup_steps=1", "--skip-memory-check"]


def predict(flags: list[str], world: int, hardware: Hardware, device: str = "cpu") -> float:
    """The model's step time for the recipe run these flags launch on ``world`` ranks."""
    config, dims = check_command(recipe_argv(flags, 1), world)
    args = _cli._parse(_cli._parser(), plan_argv(config, dims, device, hardware.memory))
    _name, model, _notes = _cli._model_args(args)
    layout = _cli._layout(args)
    return predict_step_time(layout, model_costs(layout, ModelBuilder.llama(model)), hardware).seconds


def measure(flags: list[str], world: int, *, steps: int, warmup: int, timeout: float,
            failures: list[str], device: str = "cpu") -> tuple[list[float], int]:
    """Launch the recipe on ``world`` ranks (CPU, or one GPU each): (each timed step's seconds after ``warmup`` steps,
    tokens per step over all ranks). A launch that fails is tried once more; its error's last
    lines go to ``failures`` (and into the JSON line: a failure is reported, not hidden)."""
    for attempt in range(2):
        with tempfile.TemporaryDirectory() as tmp:
            metrics = Path(tmp) / "metrics.jsonl"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   str(ROOT / "recipes" / "train.py"), *recipe_argv(flags, steps), "--metrics-file", str(metrics)]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   "OMP_NUM_THREADS": "1", **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {})}
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp)
            if done.returncode == 0:
                records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
                tokens = records[1]["tokens"] - records[0]["tokens"]  # per step, all ranks
                return [tokens / r["tokens_per_s"] for r in records[warmup:]], tokens
            kept = Path(tempfile.mkdtemp(prefix="plan-accuracy-failed-")) / "stderr.txt"
            kept.write_text(done.stderr)  # whole: a rank's faulthandler stacks are above torchrun's summary
            failures.append(f"{world} ranks {' '.join(flags)} (attempt {attempt + 1}, exit {done.returncode}, "
                            f"stderr in {kept}): " + " | ".join(done.stderr.strip().splitlines()[-3:]))
            print(f"launch failed ({done.returncode}), {'retrying' if attempt == 0 else 'giving up'}: "
                  f"{failures[-1]}", file=sys.stderr, flush=True)
    raise RuntimeError(f"{' '.join(cmd)} failed twice ({done.returncode}):\n{done.stderr[-3000:]}")


def mean_profile(profiles: list[Hardware]) -> Hardware:
    """The profiles' mean, figure by figure (calibrations of one world at different times)."""
    fields = {f.name: getattr(profiles[0], f.name) for f in dataclasses.fields(Hardware)}
    for name, value in fields.items():
        if isinstance(value, float):
            fields[name] = statistics.fmean(getattr(h, name) for h in profiles)
    return Hardware(**fields)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties take their mean rank)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def summary(rows: list[dict], profiles: dict[int, Hardware], wall: float, failures: list[str],
            transport: str = "gloo (CPU)") -> dict:
    """The JSON line. ``best_gap`` compares what the search ranks by, tokens/s per rank (the
    layouts run different batches on different worlds: a step's seconds alone would rank the
    smallest batch first): the measured seconds per token per rank of the layout the model
    ranks first, over the least measured, minus 1. ``best_gap_step`` is the same on raw step times."""
    predicted, measured = [r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]
    per_token = [(r["world"] / r["tokens"], r) for r in rows]  # seconds per token per rank = step x this
    cost_p = [k * r["predicted_s"] for k, r in per_token]
    cost_m = [k * r["measured_s"] for k, r in per_token]
    first, first_step = (min(range(len(rows)), key=v.__getitem__) for v in (cost_p, predicted))
    return {"spearman": round(spearman(predicted, measured), 4),
            "median_abs_error": round(statistics.median(abs(r["error"]) for r in rows), 4),
            "best_gap": round(cost_m[first] / min(cost_m) - 1, 4),
            "model_first": rows[first]["layout"], "fastest": rows[cost_m.index(min(cost_m))]["layout"],
            "best_gap_step": round(measured[first_step] / min(measured) - 1, 4),
            "failed_launches": failures,
            "transport": transport, "torch": torch.__version__, "worlds": sorted(profiles),
            "cpus": os.cpu_count(), "wall_s": round(wall, 1),
            "profiles": {w: json.loads(h.to_json()) for w, h in profiles.items()}, "rows": rows}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 layouts, 3 steps (a smoke test)")
    parser.add_argument("--steps", type=int, default=7, help="steps per launch")
    parser.add_argument("--warmup", type=int, default=2, help="first steps not timed")
    parser.add_argument("--rounds", type=int, default=2,
                        help="launches per layout, in alternating order (forward, backward, ...); "
                             "a layout's measured step is the median of all its timed steps")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON line to this file")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the GPU layouts (one rank, bf16, ~1B parameters) on this machine's first GPU, "
                             "predicted with --hardware's profile instead of a calibration")
    parser.add_argument("--hardware", default="h200",
                        help="with --device cuda: the profile to predict with (a preset name or a JSON file)")
    parser.add_argument("--gpu-layouts", action="store_true",
                        help="with --device cpu: the GPU layouts' flags at toy size (checks that pipeline on CPU)")
    return parser


def gpu_matmul_flops(n: int = 8192, repeats: int = 20) -> float:
    """bf16 FLOP/s of n x n matmuls on this process's GPU (what flops_efficiency x peak_flops stands for)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    torch.cuda.synchronize()
    flops = 2 * n**3 * repeats / (time.perf_counter() - start)
    del a, b
    torch.cuda.empty_cache()
    return flops


def _layouts(args: argparse.Namespace) -> list[tuple[str, int, list[str]]]:
    if args.device == "cpu" and not args.gpu_layouts:
        return QUICK if args.quick else LAYOUTS
    gpu = GPU_LAYOUTS[:2] if args.quick else GPU_LAYOUTS
    if args.device == "cuda" and not args.quick:
        return gpu
    toy = []  # the same layouts, model flags swapped for a toy's, precision fp32 on CPU
    for name, world, flags in gpu:
        kept = [f for f in flags if not f.startswith(("--model.", "--training.seq_len="))]
        if args.device == "cpu":
            kept = [f for f in kept if f != "--training.mixed_precision=bf16"]
        toy.append((f"toy {name}", world, [*_TOY_GPU, *kept]))
    return toy


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("plan_accuracy.py: --device cuda but torch sees no GPU here")
    layouts = _layouts(args)
    steps, warmup, rounds = (3, 1, 1) if args.quick else (args.steps, args.warmup, args.rounds)
    start = time.perf_counter()
    comm_bytes = 2**20 if args.quick else 16 * 2**20  # (the quick run checks the pipeline, not the figures)
    worlds = sorted({world for _, world, _ in layouts})
    measured_profiles: dict[int, list[Hardware]] = {w: [] for w in worlds}
    extra: dict[str, object] = {}
    if args.device == "cuda":  # a GPU's figures are its preset's; its measured matmul rate goes beside them
        preset = load_hardware(args.hardware)
        flops = gpu_matmul_flops()
        extra = {"gpu": torch.cuda.get_device_name(0), "hardware": args.hardware,
                 "measured_bf16_matmul_flops": round(flops), "preset_matmul_flops": preset.peak_flops *
                 preset.flops_efficiency}
        print(f"bf16 8192^3 matmuls: {flops / 1e12:.0f} TFLOP/s measured; the profile assumes "
              f"{preset.peak_flops * preset.flops_efficiency / 1e12:.0f}", file=sys.stderr, flush=True)
    failures: list[str] = []
    timed: dict[int, list[float]] = {i: [] for i in range(len(layouts))}
    tokens: dict[int, int] = {}
    for r in range(rounds):  # alternating order: a drift in the machine's load hits every layout alike
        if args.device == "cpu":
            for w in worlds:  # each round calibrated anew: the profile is the rounds' mean
                # (one rank: the two-rank profile, the least calibrate times collectives over)
                measured_profiles[w].append(calibrate(world=max(w, 2), comm_bytes=comm_bytes))
        order = range(len(layouts)) if r % 2 == 0 else reversed(range(len(layouts)))
        for i in order:
            _name, world, flags = layouts[i]
            seconds, tokens[i] = measure(flags, world, steps=steps, warmup=warmup, timeout=args.timeout,
                                         failures=failures, device=args.device)
            timed[i] += seconds
            print(f"round {r + 1}: {world} ranks: {_name}: {statistics.median(seconds):.3f} s a step", file=sys.stderr,
                  flush=True)
    profiles = ({w: mean_profile(measured_profiles[w]) for w in worlds} if args.device == "cpu" else
                {w: preset for w in worlds})
    rows = []
    print(f"{'layout':<26} {'predicted s':>11} {'measured s':>10} {'error':>7}", flush=True)
    for i, (name, world, flags) in enumerate(layouts):
        measured = statistics.median(timed[i])
        predicted = predict(flags, world, profiles[world], args.device)
        rows.append({"layout": f"{world} ranks: {name}", "world": world, "flags": flags, "tokens": tokens[i],
                     "predicted_s": round(predicted, 4), "measured_s": round(measured, 4),
                     "error": round(predicted / measured - 1, 4), "steps_s": [round(s, 4) for s in timed[i]]})
        print(f"{rows[-1]['layout']:<26} {predicted:>11.3f} {measured:>10.3f} {predicted / measured - 1:>+7.1%}",
              flush=True)
    transport = "gloo (CPU)" if args.device == "cpu" else f"nccl, one rank on {extra['gpu']}"
    line = json.dumps({**summary(rows, profiles, time.perf_counter() - start, failures, transport), **extra})
    if args.out:
        args.out.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
