"""The recipe's tiny Llama trained with and without int8 communication: bytes per step and losses.

    torchrun --standalone --nproc-per-node 2 benchmarks/quantized_comm.py            # 300 steps each
    torchrun --standalone --nproc-per-node 2 benchmarks/quantized_comm.py --steps 20 --out qc.jsonl
    python benchmarks/quantized_comm.py --plot qc.png qc.jsonl   # the loss curves (needs matplotlib)

Issue #29's benchmark. One launch trains the recipe's config (``--config``, default
recipes/configs/tiny.toml) three times in the same processes, each from the same seed, on
the same batches, with the recipe's own building blocks (``recipes.train.build_model``,
``build_optimizer``, ``lr_schedule``, ``train_step``; ``recipes.llama.parallelize``):

- ``off``:     every group communicates as the recipe's mixed precision says;
- ``weights``: ``--parallelism.quantize_weights=int8`` (int8 all-gathers);
- ``both``:    ... and ``--parallelism.quantize_gradients=int8`` (int8 all-to-all reductions).

``fsdp2.count_comm_bytes`` counts the bytes each rank sends in the groups' collectives
during every step (exact, from the transports' sizes); ``bytes_per_step`` is rank 0's mean
over the steps. ``bytes_ratio_weights`` and ``bytes_ratio_both`` are those against ``off``'s,
i.e. against the run's own unquantized communication: with the tiny config's fp32 that is
fp32 all-gathers and fp32 reduce-scatters (the recipe's bf16 all-gathers in bf16 and always
reduces in fp32). ``bf16_bytes_per_step`` is the same model's bytes for one step (the second)
with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`` (issue #29's reference,
all communication in bf16), and ``bytes_ratio_*_vs_bf16`` the ratios against it.

A run's final loss (``final_loss_*``) is the mean over the last 10 steps of the training
loss averaged over the ranks; ``final_loss_rel_*`` is its relative difference from ``off``'s
(issue #29 asks for 1%). Rank 0 prints one JSON line at the end; ``--out FILE`` appends one
line per run (its per-step losses and bytes) and then that summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `recipes` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

import fsdp2
from recipes.config import DEFAULT_CONFIG, JobConfig
from recipes.data import load_corpus, split_corpus
from recipes.llama.model import Transformer
from recipes.llama.parallelize import ParallelDims
from recipes.train import build_model, build_optimizer, check_command, lr_schedule, train_step, validate

RUNS = {
    "off": [],
    # the noise floor: unquantized, every initial weight scaled by (1 + 1e-6 * N(0, 1))
    "off_jitter": [],
    "weights": ["--parallelism.quantize_weights=int8"],
    "both": ["--parallelism.quantize_weights=int8", "--parallelism.quantize_gradients=int8"],
    "weights_int4": ["--parallelism.quantize_weights=int4"],
    "both_int4": ["--parallelism.quantize_weights=int4", "--parallelism.quantize_gradients=int4"],
    # HSDP (--set parallelism.dp_replicate=2): the all-reduce across replicas quantized too
    "both_replicas": ["--parallelism.quantize_weights=int8", "--parallelism.quantize_gradients=int8",
                      "--parallelism.quantize_gradient_axes=both"],
    "both_int4_replicas": ["--parallelism.quantize_weights=int4", "--parallelism.quantize_gradients=int4",
                           "--parallelism.quantize_gradient_axes=both"],
}
DEFAULT_RUNS = "off,weights,both"
FINAL_WINDOW = 10  # the final training loss is the mean of this many last steps
VALIDATE_EVERY = 50


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="the recipe config to train (default: tiny.toml)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the config's)")
    p.add_argument("--block-size", type=int, default=256, help="parallelism.quantize_block_size (default 256)")
    p.add_argument("--error-feedback", action="store_true",
                   help="the runs with quantized gradients with parallelism.quantize_error_feedback=true")
    p.add_argument("--runs", default=DEFAULT_RUNS,
                   help=f"which runs, comma-separated, 'off' first (default {DEFAULT_RUNS}; also: "
                        f"{', '.join(n for n in RUNS if n not in DEFAULT_RUNS.split(','))})")
    p.add_argument("--skip-off", action="store_true",
                   help="leave out the 'off' run (its losses from an earlier launch): no summary, --out lines only")
    p.add_argument("--seed", type=int, default=None, help="training.seed of every run (default: the config's)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="where the node boundary lies for across_nodes_per_step (default: LOCAL_WORLD_SIZE, "
                        "i.e. each torchrun launch is a node)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe setting for every run, e.g. --set parallelism.dp_replicate=2 (repeatable)")
    p.add_argument("--val-batches", type=int, default=32,
                   help="held-out batches per rank in each validation (default 32)")
    p.add_argument("--out", metavar="FILE", help="append each run's per-step losses and the summary (JSON lines)")
    p.add_argument("--plot", metavar="PNG", help="draw the loss curves of the given --out files instead of training")
    p.add_argument("files", nargs="*", help="with --plot: JSON lines written by --out")
    return p


def run_args(args: argparse.Namespace, name: str) -> list[str]:
    """The recipe command line of run ``name``."""
    argv = ["--config", args.config, f"--parallelism.quantize_block_size={args.block_size}", *RUNS[name],
            "--validation.enable=true", f"--validation.steps={args.val_batches}"]
    if args.steps is not None:
        argv.append(f"--training.steps={args.steps}")
    if args.seed is not None:
        argv.append(f"--training.seed={args.seed}")
    argv += [f"--{setting}" for setting in args.set]
    if "--parallelism.quantize_gradients" in " ".join(RUNS[name]) and args.error_feedback:
        argv.append("--parallelism.quantize_error_feedback=true")
    return argv


JITTER = 1e-6


def train_run(config: JobConfig, dims: ParallelDims, device: torch.device, corpus: torch.Tensor,
              ranks_per_node: int | None = None, jitter: bool = False) -> dict:
    """Train ``config`` from its seed on ``corpus`` less its held-out tail; per step, the loss
    (averaged over ranks) and the bytes this rank sent; the held-out loss every
    ``VALIDATE_EVERY`` steps and after the last."""
    t = config.training
    corpus, held_out = split_corpus(corpus, config.validation.split)
    torch.manual_seed(t.seed)
    model = build_model(config, dims, device)
    if jitter:  # as little a change as a different summation order makes, at the start
        g = torch.Generator(device=device).manual_seed(t.seed * 1000 + dist.get_rank())
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local()
                local.mul_(1 + JITTER * torch.randn(local.shape, generator=g, device=device, dtype=local.dtype))
    optimizer = build_optimizer(model, t)
    scheduler = lr_schedule(optimizer, t)
    dp_rank = dims.dp_rank(dist.get_rank())
    losses, sent, val = [], [], {}
    started = time.perf_counter()
    for step in range(1, t.steps + 1):
        with fsdp2.count_comm_bytes(ranks_per_node) as counted:
            result = train_step(model, optimizer, scheduler, corpus, step, dp_rank, t, device)
        loss = result.loss
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # outside the counter (and not a group's: not counted)
        losses.append(loss.item())
        sent.append({"all_gather": counted.all_gather, "reduce_scatter": counted.reduce_scatter,
                     "all_reduce": counted.all_reduce, "across_nodes": counted.across_nodes})
        if step % VALIDATE_EVERY == 0 or step == t.steps:
            val[step] = validate(model, held_out, dp_rank, config, device)
    return {"losses": losses, "bytes": sent, "val_losses": val, "seconds": time.perf_counter() - started}


def bf16_bytes_per_step(config: JobConfig, dims: ParallelDims, device: torch.device, corpus: torch.Tensor) -> int:
    """Bytes rank 0 sends in one step (the second) with every collective in bf16 (param and reduce dtype)."""
    t = config.training
    torch.manual_seed(t.seed)
    with torch.device("meta"):
        model = Transformer(config.model)
    policy = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model.layers:  # as recipes.llama.parallelize.apply_fsdp, with bf16 reductions
        fsdp2.fully_shard(block, mesh=dims.dp_mesh(), mp_policy=policy)
    fsdp2.fully_shard(model, mesh=dims.dp_mesh(), mp_policy=policy)
    model.to_empty(device=device)
    model.init_weights(seed=t.seed)
    optimizer = build_optimizer(model, t)
    scheduler = lr_schedule(optimizer, t)
    dp_rank = dims.dp_rank(dist.get_rank())
    for step in (1, 2):
        with fsdp2.count_comm_bytes() as counted:
            train_step(model, optimizer, scheduler, corpus, step, dp_rank, t, device)
    return counted.total


def per_step(run: dict, kinds: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce")) -> int:
    return round(sum(b[k] for b in run["bytes"] for k in kinds) / len(run["bytes"]))


def final_loss(run: dict) -> float:
    return sum(run["losses"][-FINAL_WINDOW:]) / len(run["losses"][-FINAL_WINDOW:])


def final_val_loss(run: dict) -> float:
    return run["val_losses"][max(run["val_losses"])]


def summarize(runs: dict[str, dict], bf16: int, config: JobConfig, dims: ParallelDims,
              args: argparse.Namespace) -> dict:
    off = runs["off"]
    summary = {
        "config": {"config": Path(args.config).name, "steps": config.training.steps, "world": dims.world_size,
                   "seed": config.training.seed, "mixed_precision": config.training.mixed_precision,
                   "reduce_dtype": "fp32", "block_size": args.block_size, "error_feedback": args.error_feedback,
                   "settings": args.set,
                   "final_loss": f"mean of the last {FINAL_WINDOW} steps' training loss",
                   "final_val_loss": f"held-out loss after the last step ({config.validation.steps} batches "
                                     f"per rank, the last {config.validation.split:.0%} of the data)",
                   "torch": torch.__version__},
        "bytes_per_step": {name: per_step(run) for name, run in runs.items()},
        "bf16_bytes_per_step": bf16,
        "across_nodes_per_step": {name: per_step(run, ("across_nodes",)) for name, run in runs.items()},
        "ranks_per_node": args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dims.world_size)),
    }
    quantized = [name for name in runs if name != "off"]
    for name in quantized:
        summary[f"bytes_ratio_{name}"] = round(per_step(runs[name]) / per_step(off), 4)
        summary[f"bytes_ratio_{name}_vs_bf16"] = round(per_step(runs[name]) / bf16, 4)
    for name, run in runs.items():
        summary[f"final_loss_{name}"] = round(final_loss(run), 5)
        summary[f"final_val_loss_{name}"] = round(final_val_loss(run), 5)
    for name in quantized:
        summary[f"final_loss_rel_{name}"] = round(final_loss(runs[name]) / final_loss(off) - 1, 5)
        summary[f"final_val_loss_rel_{name}"] = round(final_val_loss(runs[name]) / final_val_loss(off) - 1, 5)
    summary["seconds"] = {name: round(run["seconds"], 1) for name, run in runs.items()}
    return summary


def measure(args: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    names = args.runs.split(",")
    if names[0] != "off" or any(n not in RUNS for n in names) or len(set(names)) != len(names):
        raise SystemExit(f"--runs {args.runs!r}: 'off' first, then any of {', '.join(n for n in RUNS if n != 'off')}")
    if args.skip_off:
        names = names[1:]
    configs = {name: check_command(run_args(args, name), world) for name in names}  # before any process group
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        runs = {}
        for name, (config, dims) in configs.items():
            dims.build_mesh(device.type)
            corpus = load_corpus(config.data.path)
            runs[name] = train_run(config, dims, device, corpus, args.ranks_per_node, jitter=name == "off_jitter")
            if dist.get_rank() == 0:
                print(f"{name}: final loss {final_loss(runs[name]):.4f}, held-out {final_val_loss(runs[name]):.4f}, "
                      f"{per_step(runs[name]):,} bytes/step, "
                      f"{runs[name]['seconds']:.0f} s", file=sys.stderr, flush=True)
        config, dims = next(iter(configs.values()))
        if dist.get_rank() == 0 and args.out:
            with open(args.out, "a") as f:
                for name, run in runs.items():
                    f.write(json.dumps({"run": name, "steps": config.training.steps, **run}) + "\n")
        if "off" in runs:
            bf16 = bf16_bytes_per_step(config, dims, device, corpus)
            if dist.get_rank() == 0:
                summary = summarize(runs, bf16, config, dims, args)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(summary) + "\n")
                print(json.dumps(summary), flush=True)
    finally:
        dist.destroy_process_group()


def plot(paths: list[str], png: str) -> None:
    """The loss curves of the runs in ``paths`` (the last line of each run name wins). Needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    runs = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                record = json.loads(line) if line.strip() else {}
                if "run" in record:
                    runs[record["run"]] = record["losses"]
    if not runs:
        raise SystemExit(f"{', '.join(paths) or 'no files'}: no runs (write them with --out FILE)")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = {"off": "unquantized", "weights": "int8 weights", "both": "int8 weights + gradients",
              "weights_int4": "int4 weights", "both_int4": "int4 weights + gradients",
              "both_replicas": "int8 weights + gradients, replicas' all-reduce too",
              "both_int4_replicas": "int4 weights + gradients, replicas' all-reduce too"}
    for name, losses in runs.items():
        ax.plot(range(1, len(losses) + 1), losses, label=labels.get(name, name), linewidth=1)
    ax.set(xlabel="step", ylabel="training loss (mean over ranks)", title="tiny Llama, quantized communication")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.plot:
        return plot(args.files, args.plot)
    if args.files:
        raise SystemExit(f"unexpected arguments {args.files}: files are read with --plot only")
    measure(args)


if __name__ == "__main__":
    main()
