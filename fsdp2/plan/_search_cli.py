"""``python -m fsdp2.plan --search``: its flags, and the ranked table it shows (``_cli.py`` calls both).

    python -m fsdp2.plan --search --config llama3_8b --world 64 --global-batch 256 --seq 8192 --hardware h100

See ``_search.py`` for how layouts are enumerated, sized and ranked, and
docs/planning.md ("Search").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from ._cli_args import _positive
from ._layout import Layout, ModelBuilder
from ._planner import Reserve
from ._search import (
    Evaluated, FastMemory, SearchResult, enumerate_layouts, model_overrides, no_layout_reason, recipe_flags,
    recipe_overrides, search,
)
from ._costs import model_costs
from ._hardware import load_hardware
from ._steptime import StepTime, predict_step_time
from ..memory._tracker import format_bytes, format_table
from ..models.llama import LLAMA3, ModelArgs

__all__ = ["add_search_arguments", "search_report"]

SEARCH_HARDWARE = "h100"  # the profile --search predicts for when --hardware is not given


def add_search_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("the search (--search: every layout the recipe runs, the fastest that fit)")
    s.add_argument("--search", action="store_true",
                   help="rank the layouts of --world ranks for --global-batch by predicted speed, among those that "
                        "fit --gpu-memory; the layout flags (--tp, --batch, ...) are ignored")
    s.add_argument("--global-batch", type=_positive, default=None, help="sequences per optimizer step (with --search)")
    s.add_argument("--top", type=_positive, default=5, help="layouts in the ranked table")
    s.add_argument("--search-json", type=Path, default=None, metavar="FILE",
                   help="write every layout evaluated, with its scores, as JSON (recipes/train.py --layout-from FILE)")


def _name(layout: Layout) -> str:
    pp = f"pp{layout.pp} {layout.pp_schedule} x " if layout.pp > 1 else ""
    ep = f" (ep{layout.ep})" if layout.ep > 1 else ""
    tp = f" x tp{layout.tp}" if layout.tp > 1 else ""
    mesh = f"HSDP {layout.dp_replicate}x{layout.dp_shard}" if layout.dp_replicate > 1 else f"FSDP {layout.dp_shard}"
    return pp + mesh + ep + tp


def _row(rank: int | str, e: Evaluated) -> tuple[str, ...]:
    lay, step = e.layout, e.step
    reshard = recipe_overrides(lay)["parallelism.reshard_after_forward"]
    return (str(rank), _name(lay), "full" if lay.activation_checkpointing else "none", str(reshard),
            "int8" if lay.comm_policy else "-", f"{lay.batch} x {lay.grad_accum}",
            f"{step.tokens_per_s_per_device:,.0f}", f"{100 * step.mfu:.1f}%",
            format_bytes(e.needed_bytes) if e.needed_bytes is not None else "-", step.limit)


HEADER = ("#", "layout", "AC", "reshard", "quantized", "batch x accum", "tokens/s/device", "MFU", "needed/rank",
          "limited by")


def _entry(e: Evaluated, rank: int | None) -> dict[str, Any]:
    step = e.step
    fields = dataclasses.asdict(step) if dataclasses.is_dataclass(step) else dict(vars(step))
    lay = e.layout
    return {"rank": rank, "fits": e.fits, "tokens_per_s_per_device": step.tokens_per_s_per_device, "mfu": step.mfu,
            "seconds": step.seconds, "limit": step.limit, "step": fields, "peak_bytes": e.peak_bytes,
            "needed_bytes": e.needed_bytes,
            "memory": e.how,
            "layout": {"world": lay.world, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "tp": lay.tp,
                       "pp": lay.pp, "ep": lay.ep, "pp_schedule": lay.pp_schedule if lay.pp > 1 else None,
                       "pp_microbatches": lay.pp_microbatches, "batch": lay.batch, "grad_accum": lay.grad_accum,
                       "seq": lay.seq, "activation_checkpointing": lay.activation_checkpointing,
                       "reshard_after_forward": lay.reshard_after_forward,
                       "root_reshard_after_forward": lay.root_reshard_after_forward,
                       "quantized": bool(lay.comm_policy)},
            "recipe": recipe_overrides(lay)}


def write_json(path: Path, result: SearchResult, header: dict[str, Any]) -> None:
    """Every layout evaluated: those that fit first (fastest first: entry 0 is the winner), then the rest."""
    fitting = {id(e) for e in result.ranked}
    entries = [_entry(e, i) for i, e in enumerate(result.ranked)]
    entries += [_entry(e, None) for e in result.evaluated if id(e) not in fitting]
    path.write_text(json.dumps({**header, "layouts": entries}, indent=1) + "\n")


def _model_flags(args: argparse.Namespace, model: ModelArgs) -> list[str]:
    if args.config is not None and args.config not in LLAMA3:
        return [f"--config {args.config}"]  # the recipe's TOML: its model as it is
    return [f"--{key}={str(value).lower() if isinstance(value, bool) else value}"
            for key, value in model_overrides(model).items()]


def search_report(args: argparse.Namespace, *, name: str, model: ModelArgs, param_dtype: torch.dtype,
                  reserve: Reserve) -> str:
    """Enumerate, size and rank; the table and the winner's recipe flags, as text. ValueError for no layout."""
    if args.global_batch is None:
        raise ValueError("--search needs --global-batch: the sequences per optimizer step, over all ranks")
    builder = ModelBuilder.llama(model)  # one builder: model_costs runs once for every layout
    hw = load_hardware(args.hardware or SEARCH_HARDWARE)

    def score(layout: Layout) -> StepTime:
        return predict_step_time(layout, model_costs(layout, builder), hw)

    scorer = f"the step-time model ({hw.name})"
    gpu_memory = args.gpu_memory or hw.memory
    start, cpu = time.perf_counter(), time.process_time()
    layouts = enumerate_layouts(model, world=args.world, global_batch=args.global_batch, seq=args.seq,
                                devices_per_node=hw.devices_per_node, param_dtype=param_dtype,
                                optimizer=args.optimizer, backend=args.backend)
    if not layouts:
        raise ValueError(no_layout_reason(model, world=args.world, global_batch=args.global_batch, seq=args.seq,
                                          devices_per_node=hw.devices_per_node))
    result = search(layouts, score=score, memory=FastMemory(builder, reserve), gpu_memory=gpu_memory, top=args.top)
    elapsed = time.perf_counter() - start
    if args.search_json is not None:
        write_json(args.search_json, result, {
            "model": name, "model_args": dataclasses.asdict(model), "world": args.world,
            "global_batch": args.global_batch, "seq": args.seq, "hardware": hw.name, "gpu_memory": gpu_memory,
            "scorer": scorer})
    if not result.ranked:
        closest, needed, floor = result.closest()
        raise ValueError(f"no layout of {args.world} ranks fits in {format_bytes(gpu_memory)}: the closest, "
                         f"{_name(closest.layout)} (activation checkpointing {_row(0, closest)[2]}, micro-batch "
                         f"{closest.layout.batch}), needs {'at least ' * floor}{format_bytes(needed)} "
                         f"({'its reserve alone; ' * floor}{format_bytes(needed - gpu_memory)} over); add ranks "
                         "(--world), shorten --seq, lower --global-batch or give more --gpu-memory")
    nodes = max(1, args.world // hw.devices_per_node)
    recipe = " ".join(_model_flags(args, model) + recipe_flags(result.ranked[0].layout))
    lines = [f"{name}: world {args.world}, {args.global_batch} sequences x {args.seq} tokens per step, "
             f"{format_bytes(gpu_memory)} per device, scored by {scorer}",
             format_table([_row(i + 1, e) for i, e in enumerate(result.ranked)], HEADER),
             f"{len(layouts)} layouts scored, {len(result.checked)} sized ({result.simulations} simulations, the "
             f"rest derived from them), {sum(bool(e.fits) for e in result.checked)} of those fit; {elapsed:.1f} s "
             f"({time.process_time() - cpu:.1f} s of CPU)",
             f"the fastest, with the recipe:\n  torchrun --nnodes {nodes} --nproc-per-node "
             f"{min(args.world, hw.devices_per_node)} recipes/train.py {recipe}"]
    if args.search_json is not None:
        lines.append(f"every layout and its scores: {args.search_json} (recipes/train.py --layout-from "
                     f"{args.search_json})")
    return "\n".join(lines)
