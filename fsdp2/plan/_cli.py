"""``python -m fsdp2.plan``: will a Llama-style model fit on a layout, before launch.

    python -m fsdp2.plan --config llama3_70b --world 64 --tp 8 --gpu-memory 80GiB
    python -m fsdp2.plan --config llama3_8b --world 8 --compare
    python -m fsdp2.plan --dim 2048 --n-layers 16 --n-heads 16 --n-kv-heads 4 --world 8
    python -m fsdp2.plan --hf-config path/to/config.json --world 8 --activation-checkpointing full
    python -m fsdp2.plan --hf-config path/to/Llama-3.1-8B --world 8 --gpu-memory 80GB
    python -m fsdp2.plan --config recipes/configs/llama3_8b.toml --world 8 --gpu-memory 80GB

Builds two blocks of the recipe's Llama (``fsdp2.models.llama``) on the meta device (no
memory), runs fsdp2 on them over a fake process group of the layout's world size (a warm-up
step, then one counted by a ``MemoryTracker``) and extrapolates to the model's blocks, then
adds what a GPU process holds besides (CUDA context, NCCL buffers, allocator fragmentation:
``fsdp2.plan.Reserve``). When the layout does not fit, it tries the nearest changes
(activation checkpointing, resharding, FSDP instead of HSDP, a smaller micro-batch, tensor
parallelism, more GPUs) and prints those that fit. See docs/memory.md.

``--config`` also takes a recipe's TOML file (``recipes/configs/*.toml``) as it is: its
[model] table is the model, and its [training] and [parallelism] tables the layout (batch,
sequence, accumulation, precision, activation checkpointing, resharding, quantization, the
mesh); flags given on the command line override them. ``check_fit`` asks the same question
from Python (the recipe's pre-flight check does, before it allocates).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tomllib
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch

from .._api import QuantizedComm
from ._search_cli import add_search_arguments, search_report
from ._cli_args import SIZES, _ac, _bool, _count, _fraction, _positive, _reshard, _size, parse_bytes
from . import _time_cli
from ._layout import SCHEDULES, Layout, ModelBuilder
from ._planner import MemoryEstimate, Reserve, estimate_memory
from ..memory._tracker import format_bytes, format_table
from ..models.hf_config import read_hf_config
from ..models.llama import LLAMA3, ModelArgs

__all__ = ["main", "parse_bytes", "check_fit", "FitCheck"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
def _config(text: str) -> str:
    """A preset's name, or a recipe TOML file's path (read after parsing: flags override it)."""
    if text in LLAMA3 or text.endswith(".toml") or Path(text).is_file():
        return text
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(map(repr, sorted(LLAMA3)))}, "
                                     "or give a recipe's .toml file)")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in --help, except where there is none (None) or for on/off switches."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


RESERVE_DEFAULTS = {"context": "1GiB", "nccl_per_group": "512MiB"}  # Reserve()'s, as --help shows them


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fsdp2.plan", description=__doc__.split("\n\n")[0],
                                formatter_class=_Help, epilog=SIZES)
    model = p.add_argument_group("the model (a preset, a Hugging Face config.json, or dimensions; flags override)")
    model.add_argument("--config", type=_config, default=None, metavar=f"{{{','.join(sorted(LLAMA3))},FILE.toml}}",
                       help="Meta's published Llama 3 dimensions on the recipe's model, or a recipe's TOML "
                            "config (its model and layout; flags override them)")
    model.add_argument("--hf-config", type=Path, default=None, metavar="PATH",
                       help="a Hugging Face Llama config.json, or the model folder holding it (read as the "
                            "recipe's checkpoint.initial_load_path reads it: what the recipe refuses, this refuses)")
    for flag, what in (("--dim", "model width"), ("--n-layers", "blocks"), ("--n-heads", "attention heads"),
                       ("--n-kv-heads", "key/value heads (grouped-query attention)"), ("--vocab-size", "vocabulary"),
                       ("--ffn-hidden", "SwiGLU hidden size"),
                       ("--max-seq-len", "rotary table length (preset's, config's max_position_embeddings, or --seq)")):
        model.add_argument(flag, type=_positive, default=None, help=what)
    model.add_argument("--tie-embeddings", type=_bool, default=None, help="output layer shares the embedding")
    for flag, what in (("--moe-experts", "mixture of experts: routed experts per block (0: dense SwiGLU)"),
                       ("--moe-top-k", "experts each token is routed to"),
                       ("--moe-hidden", "an expert's SwiGLU width (default: the dense width / top-k)"),
                       ("--moe-shared-experts", "shared experts every token goes through (0: none)")):
        model.add_argument(flag, type=_count, default=None, help=what)
    run = p.add_argument_group("the layout")
    run.add_argument("--world", type=_positive, default=None,
                     help="total ranks (GPUs); required unless a TOML config fixes every mesh axis")
    run.add_argument("--dp-replicate", type=_positive, default=1, help="replicas (HSDP); 1 is FSDP")
    run.add_argument("--tp", type=_positive, default=1, help="tensor-parallel degree")
    run.add_argument("--ep", type=_positive, default=1,
                     help="expert-parallel degree (MoE): the shard ranks split into dp_shard/ep (experts' FSDP) x ep")
    run.add_argument("--pp", type=_positive, default=1, help="pipeline-parallel degree (torch.distributed.pipelining)")
    run.add_argument("--pp-schedule", choices=SCHEDULES, default="1F1B",
                     help="the pipeline schedule: how many microbatches' activations a stage holds at once")
    run.add_argument("--pp-microbatches", type=int, default=0, help="microbatches per batch; 0: one per stage")
    run.add_argument("--pp-layers-per-stage", type=int, default=0,
                     help="blocks per pipeline stage; 0: n_layers / pp (GPipe, 1F1B), else n_layers / (2 pp)")
    run.add_argument("--batch", type=_positive, default=1, help="sequences per data-parallel rank per micro-batch")
    run.add_argument("--grad-accum", type=_positive, default=1, help="micro-batches per optimizer step")
    run.add_argument("--seq", type=_positive, default=8192, help="tokens per sequence")
    run.add_argument("--param-dtype", choices=sorted(DTYPES), default="bf16", help="compute and all-gather dtype")
    run.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="fp32", help="reduce-scatter dtype")
    run.add_argument("--backend", choices=["nccl", "gloo"], default="nccl",
                     help="nccl: GPUs; gloo: CPU ranks (fsdp2's CPU transport, and nothing reserved)")
    run.add_argument("--reshard-after-forward", type=_reshard, default=True, metavar="{true,false,N}",
                     help="free each block's gathered parameters after its forward (with --pp: default false); "
                          "N: keep 1/N of them, so backward gathers over N ranks (e.g. 8: the GPUs of a node)")
    run.add_argument("--activation-checkpointing", type=_ac, default="none", metavar="{none,full}",
                     help="full: every block recomputes its forward in backward (true/false also accepted)")
    run.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd", "sgd_momentum"],
                     help="its state per parameter: adamw/adam 2 values, sgd_momentum 1, sgd none")
    run.add_argument("--quantize-weights", choices=["int8", "int4"], default=None,
                     help="all-gather the weights quantized (QuantizedComm(weights=...))")
    run.add_argument("--quantize-gradients", choices=["int8", "int4"], default=None,
                     help="reduce the gradients quantized (QuantizedComm(gradients=...))")
    run.add_argument("--quantize-gradient-axes", choices=["shard", "replicate", "both"], default="shard",
                     help="with HSDP, which reductions of the gradients are quantized")
    run.add_argument("--error-feedback", action="store_true",
                     help="keep each rank's gradient quantization error (an fp32 copy of the model per rank)")
    add_search_arguments(p)
    fit = p.add_argument_group("the verdict")
    fit.add_argument("--gpu-memory", type=_size, default=None, help="memory per GPU, e.g. 80GiB")
    fit.add_argument("--reserve-context", type=parse_bytes, default=RESERVE_DEFAULTS["context"],
                     help="reserved for the CUDA context, kernels, cuBLAS/cuDNN (outside torch's allocator)")
    fit.add_argument("--reserve-nccl", type=parse_bytes, default=RESERVE_DEFAULTS["nccl_per_group"],
                     help="reserved for NCCL's buffers, per communicator (mesh axis of 2+ ranks)")
    fit.add_argument("--fragmentation", type=_fraction, default=Reserve.fragmentation,
                     help="reserved for the caching allocator's fragmentation, as a fraction of the simulated peak")
    fit.add_argument("--no-reserve", action="store_true", help="reserve nothing: compare the simulated peak alone")
    fit.add_argument("--compare", action="store_true", help="one row per candidate layout, by peak")
    _time_cli.add_flags(p)  # --hardware, --calibrate
    return p


# ---- a recipe's TOML config ------------------------------------------------------------------
# The recipe's defaults for the keys the layout reads (recipes/config.py's dataclasses; fsdp2 does
# not import the recipes, tests/tools/test_recipe_preflight.py checks these equal them).
RECIPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "training": {"batch_size": 8, "seq_len": 128, "grad_accum": 1, "mixed_precision": "fp32",
                 "activation_checkpoint": False},
    "parallelism": {"dp_replicate": 1, "dp_shard": -1, "tp": 1, "ep": 1, "pp": 1, "pp_schedule": "1F1B",
                    "pp_microbatches": 0, "pp_layers_per_stage": 0, "reshard_after_forward": "default",
                    "quantize_weights": "", "quantize_gradients": "", "quantize_error_feedback": False,
                    "quantize_gradient_axes": "shard"},
}
# recipe mixed_precision -> (--param-dtype, --reduce-dtype); reshard_after_forward -> (blocks, root)
# (an int N: (N, False), the blocks resharded to N ranks, the root kept as "default" keeps it)
_RECIPE_PRECISION = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "fp32")}
_RECIPE_RESHARD = {"default": (True, False), "always": (True, True), "never": (False, False)}


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not valid TOML ({e})") from None
    known = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(data.get("model", {})) - known)
    if unknown:
        raise ValueError(f"--config {path}: [model] has keys the recipe's Llama does not: {', '.join(unknown)}")
    return data


def _apply_recipe_toml(args: argparse.Namespace, given: set[str]) -> None:
    """Fill ``args`` from the recipe TOML named by ``--config``: its layout where no flag was given.

    The model's dimensions come from its [model] table in ``_model_args``; here the [training]
    and [parallelism] tables, with the recipe's defaults for missing keys, as the recipe runs it.
    """
    path = Path(args.config)
    data = _read_toml(path)
    args.recipe_model = data.get("model", {})
    t = {**RECIPE_DEFAULTS["training"], **data.get("training", {})}
    p = {**RECIPE_DEFAULTS["parallelism"], **data.get("parallelism", {})}
    reshard = p["reshard_after_forward"]
    per_node = isinstance(reshard, int) and not isinstance(reshard, bool) and reshard >= 1
    if t["mixed_precision"] not in _RECIPE_PRECISION or not (per_node or reshard in _RECIPE_RESHARD):
        raise ValueError(f"--config {path}: training.mixed_precision must be fp32 or bf16 and "
                         "parallelism.reshard_after_forward default, always, never or a positive int")
    param, reduce = _RECIPE_PRECISION[t["mixed_precision"]]
    blocks, root = (reshard, False) if per_node else _RECIPE_RESHARD[reshard]  # an int: the blocks, root kept
    args.recipe_reshard = p["reshard_after_forward"]  # "default" under --pp: no resharding (_parse)
    values = {"batch": t["batch_size"], "seq": t["seq_len"], "grad_accum": t["grad_accum"],
              "param_dtype": param, "reduce_dtype": reduce, "activation_checkpointing": t["activation_checkpoint"],
              "dp_replicate": p["dp_replicate"], "tp": p["tp"], "ep": p["ep"], "reshard_after_forward": blocks,
              "pp": p["pp"], "pp_schedule": p["pp_schedule"], "pp_microbatches": p["pp_microbatches"],
              "pp_layers_per_stage": p["pp_layers_per_stage"],
              "quantize_weights": p["quantize_weights"] or None, "quantize_gradients": p["quantize_gradients"] or None,
              "error_feedback": p["quantize_error_feedback"], "quantize_gradient_axes": p["quantize_gradient_axes"]}
    for dest, value in values.items():
        if dest not in given:
            setattr(args, dest, value)
    if "reshard_after_forward" not in given:
        args.root_reshard_after_forward = root
    shard = p["dp_shard"]
    if shard > 0:  # the TOML fixes every axis: that is the world
        world = args.pp * args.dp_replicate * shard * args.tp  # (ep splits dp_shard: no ranks of its own)
        if args.world is None:
            args.world = world
        elif args.world != world:
            pp = f"pp {args.pp} x " if args.pp > 1 else ""
            raise ValueError(f"--world {args.world}, but {path} fixes {pp}dp_replicate {args.dp_replicate} x dp_shard "
                             f"{shard} x tp {args.tp} = {world} ranks; give --world {world} or change the file")


def _given(argv: Sequence[str]) -> set[str]:
    """The destinations of the flags ``argv`` gives (not their defaults)."""
    probe = _parser()
    for action in probe._actions:
        action.default, action.required = argparse.SUPPRESS, False
    return set(vars(probe.parse_known_args(list(argv))[0]))


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, completed by a recipe TOML's layout; ``--world`` checked last."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.recipe_model, args.root_reshard_after_forward, args.recipe_reshard = None, False, "default"
    given = _given(argv)
    if args.config is not None and args.config not in LLAMA3:
        _apply_recipe_toml(args, given)
    if args.pp > 1 and "reshard_after_forward" not in given and args.recipe_reshard == "default":
        args.reshard_after_forward = False  # pipeline stages stay gathered, as the recipe (and torchtitan) runs them
    if args.world is None:
        parser.error("--world is required (the total ranks), unless a recipe TOML's parallelism.dp_shard "
                     "fixes the mesh")
    return args


# ---- the model --------------------------------------------------------------------------------
def _hf_dims(path: Path) -> tuple[dict[str, Any], list[str]]:
    """The recipe Llama's fields from a Hugging Face config.json (a file or a model folder), read as
    the recipe reads it (``read_hf_config``: the same fields, the same refusals), and a note to print."""
    shape = read_hf_config(path, where=f"--hf-config {path}")
    dims = dict(shape.fields)
    if shape.max_position_embeddings is not None:
        dims["max_seq_len"] = shape.max_position_embeddings
    notes = [f"{path.name}: a llama config simulated as the recipe's Llama (RMSNorm, rotary attention, SwiGLU) "
             "with its dimensions"]
    return dims, notes


def _model_args(args: argparse.Namespace) -> tuple[str, ModelArgs, list[str]]:
    """(name, dimensions, notes) from --config / --hf-config and the dimension flags."""
    if args.config and args.hf_config:
        raise ValueError("give --config or --hf-config, not both")
    if args.recipe_model is not None:  # a recipe TOML: its [model] over the recipe's defaults, as it trains
        base: dict[str, Any] = dataclasses.asdict(ModelArgs(**args.recipe_model))
    else:
        base = dataclasses.asdict(LLAMA3[args.config]) if args.config else {}
    notes: list[str] = []
    if args.hf_config:
        dims, notes = _hf_dims(args.hf_config)
        base.update(dims)
    flags = {name: getattr(args, name) for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                                                    "ffn_hidden", "max_seq_len", "tie_embeddings", "moe_experts",
                                                    "moe_top_k", "moe_hidden", "moe_shared_experts")
             if getattr(args, name) is not None}
    base.update(flags)
    missing = [f"--{k.replace('_', '-')}" for k in ("dim", "n_layers", "n_heads", "vocab_size") if k not in base]
    if missing:
        raise ValueError(f"no model: give --config, --hf-config or the dimensions (missing {', '.join(missing)})")
    name = (Path(args.config).name if args.recipe_model is not None else args.config) or \
        (args.hf_config.name if args.hf_config else "custom")
    if flags and (args.config or args.hf_config):
        name += " (" + ", ".join(f"{k}={v}" for k, v in flags.items()) + ")"
    base["max_seq_len"] = max(base.get("max_seq_len", 0), args.seq)
    ffn_hidden = base.pop("ffn_hidden", None)
    if ffn_hidden is not None:  # an exact SwiGLU width: one multiple of itself (over a config's own width)
        base.pop("ffn_hidden_size", None)
        base.update(multiple_of=ffn_hidden, ffn_dim_multiplier=(ffn_hidden - 0.5) / int(8 * base["dim"] / 3))
    known = {f.name for f in dataclasses.fields(ModelArgs)}
    model = ModelArgs(**{k: v for k, v in base.items() if k in known})
    if ffn_hidden is not None and model.ffn_hidden != ffn_hidden:
        raise ValueError(f"cannot express a SwiGLU hidden size of {ffn_hidden} for dim {model.dim}")
    args.model_layers = model.n_layers  # (the pipeline's stages per rank: _layout)
    return name, model, notes


# ---- estimating -------------------------------------------------------------------------------
def _layout(args: argparse.Namespace, **fields: object) -> Layout:
    """The flags' layout; ``fields`` override some (``--compare`` and suggestions change the mesh and policies)."""
    flags = dict(world=args.world, batch=args.batch, seq=args.seq, dp_replicate=args.dp_replicate, tp=args.tp,
                 ep=args.ep,
                 param_dtype=DTYPES[args.param_dtype], reduce_dtype=DTYPES[args.reduce_dtype],
                 reshard_after_forward=args.reshard_after_forward, grad_accum=args.grad_accum,
                 activation_checkpointing=args.activation_checkpointing, optimizer=args.optimizer,
                 root_reshard_after_forward=args.root_reshard_after_forward, backend=args.backend)
    flags.update(_pipeline_fields(args, fields.get("pp", args.pp)))
    for flag, given in (("--error-feedback", args.error_feedback),
                        ("--quantize-gradient-axes", args.quantize_gradient_axes != "shard")):
        if given and not args.quantize_gradients:
            raise ValueError(f"{flag} needs --quantize-gradients int8 (or int4): it concerns quantized gradients")
    if args.quantize_weights or args.quantize_gradients:
        flags["comm_policy"] = QuantizedComm(weights=args.quantize_weights, gradients=args.quantize_gradients,
                                             error_feedback=args.error_feedback,
                                             gradient_axes=args.quantize_gradient_axes)
    return Layout(**{**flags, **fields})


def _pipeline_fields(args: argparse.Namespace, pp: int) -> dict[str, Any]:
    """Layout's pipeline fields: ``--pp-layers-per-stage`` as stages per rank (0: the schedule's default)."""
    if pp == 1:
        return {}
    per_rank, lps = 0, args.pp_layers_per_stage
    if lps:
        if lps < 0 or args.model_layers % lps or (args.model_layers // lps) % pp:
            raise ValueError(f"--pp-layers-per-stage {lps} must divide the {args.model_layers} blocks into a "
                             f"multiple of --pp {pp} stages")
        per_rank = args.model_layers // lps // pp
    if args.pp_microbatches < 0:
        raise ValueError(f"--pp-microbatches must be >= 0 (0: one per stage), got {args.pp_microbatches}")
    return dict(pp=pp, pp_schedule=args.pp_schedule, pp_microbatches=args.pp_microbatches,
                pp_stages_per_rank=per_rank)


def _reserve(args: argparse.Namespace) -> Reserve:
    if args.no_reserve or args.backend == "gloo":  # a CPU process holds no CUDA context or NCCL buffers
        return Reserve.none()
    return Reserve(context=args.reserve_context, nccl_per_group=args.reserve_nccl, fragmentation=args.fragmentation)


def _estimate(args: argparse.Namespace, model: ModelArgs, layout: Layout) -> MemoryEstimate:
    """The recipe's Llama of ``model``'s shape (two blocks built, the rest extrapolated) on ``layout``."""
    return estimate_memory(layout, ModelBuilder.llama(model), gpu_memory=args.gpu_memory, reserve=_reserve(args))


def _tp_degrees(model: ModelArgs, world: int, above: int = 1) -> list[int]:
    if model.moe_experts:  # the recipe's TP plan covers dense blocks only
        return []
    return [t for t in (2, 4, 8) if t > above and world % t == 0 and model.n_heads % t == 0
            and model.kv_heads % t == 0]


def _candidates(args: argparse.Namespace, model: ModelArgs) -> list[tuple[str, int, int]]:
    """(name, dp_replicate, tp) for FSDP, HSDP and FSDP x TP layouts that divide the world."""
    world = args.world
    out = [("FSDP", 1, 1)]
    for r in (2, 4, 8):
        if world % r == 0 and world // r > 1 and world // r % args.ep == 0:
            out.append((f"HSDP {r}x{world // r}", r, 1))
    out += [(f"FSDP x TP{t}", 1, t) for t in _tp_degrees(model, world)]
    return out


def _compare(args: argparse.Namespace, model: ModelArgs) -> str:
    rows = []
    for name, r, t in _candidates(args, model):
        for reshard in (True, False):
            for ac in (False, True):
                est = _estimate(args, model, _layout(args, dp_replicate=r, tp=t, reshard_after_forward=reshard,
                                                     activation_checkpointing=ac))
                rows.append((est.peak_bytes, (name, "on" if reshard else "off", "full" if ac else "none",
                             format_bytes(est.peak_bytes), format_bytes(est.needed_bytes), est.peak_point,
                             format_bytes(est.comm_bytes_per_step),
                             "-" if est.fits is None else "yes" if est.fits else "no")))
    rows.sort(key=lambda row: row[0])
    header = ("layout", "reshard", "AC", "peak/rank", "needed/rank", "peak at", "comm/step/rank", "fits")
    return format_table([r for _, r in rows], header)


# ---- when it does not fit: the nearest layouts that do ----------------------------------------
def _changes(args: argparse.Namespace, model: ModelArgs, layout: Layout) -> list[list[tuple[str, dict[str, Any]]]]:
    """Single changes to ``layout``, cheapest first; each a list of (flags, Layout fields) to try in
    order, of which the first that fits is suggested (e.g. the largest micro-batch that fits)."""
    out: list[list[tuple[str, dict[str, Any]]]] = []
    if not layout.activation_checkpointing:
        out.append([("--activation-checkpointing full", {"activation_checkpointing": True})])
    if layout.reshard_after_forward is not True:  # (kept, or resharded to fewer ranks: an int)
        out.append([("--reshard-after-forward true", {"reshard_after_forward": True})])
    if layout.dp_replicate > 1:
        out.append([("--dp-replicate 1", {"dp_replicate": 1})])
    batches, b = [], layout.batch // 2
    while b >= 1:  # the same tokens per step, in more micro-batches
        accum = layout.grad_accum * layout.batch // b
        batches.append((f"--batch {b} --grad-accum {accum}", {"batch": b, "grad_accum": accum}))
        b //= 2
    if batches:
        out.append(batches)
    tps = [(f"--tp {t}", {"tp": t}) for t in _tp_degrees(model, layout.world // layout.dp_replicate, layout.tp)]
    if tps:
        out.append(tps)
    if layout.pp == 1:  # pipeline stages: each rank holds 1 / pp of the blocks (1F1B, one stage per rank)
        pps = [(f"--pp {p}", {"pp": p, "reshard_after_forward": False, **_pipeline_fields(args, p)})
               for p in (2, 4, 8) if layout.world % (p * layout.dp_replicate * layout.tp) == 0
               and model.n_layers % p == 0 and layout.batch % p == 0]
        if pps:
            out.append(pps)
    out.append([(f"--world {layout.world * k}", {"world": layout.world * k}) for k in (2, 4, 8)])
    return out


def _fitting(args: argparse.Namespace, model: ModelArgs, layout: Layout) -> list[tuple[str, MemoryEstimate]]:
    """(flags, estimate) of the nearest layouts that fit: single changes, else activation checkpointing plus one."""
    def first_fit(options: list[tuple[str, dict[str, Any]]], base: Layout,
                  prefix: str = "") -> tuple[str, MemoryEstimate] | None:
        for flags, fields in options:
            try:
                candidate = dataclasses.replace(base, **fields)
                est = _estimate(args, model, candidate)
            except ValueError:  # e.g. a world that tp no longer divides
                continue
            if est.fits:
                return prefix + flags, est
        return None

    changes = _changes(args, model, layout)
    found = [fit for options in changes if (fit := first_fit(options, layout))]
    if not found and not layout.activation_checkpointing:
        with_ac = dataclasses.replace(layout, activation_checkpointing=True)
        found = [fit for options in changes[1:] if (fit := first_fit(options, with_ac,
                                                                       "--activation-checkpointing full "))]
    return found


NOTHING_FITS = ("no layout one or two changes away fits (activation checkpointing, resharding, FSDP, smaller "
                "micro-batches, --tp, up to 8x the GPUs)")


def _suggest(args: argparse.Namespace, model: ModelArgs, layout: Layout) -> list[str]:
    """Lines naming the nearest layouts that fit."""
    found = _fitting(args, model, layout)
    if not found:
        return [NOTHING_FITS + "; try --compare"]
    return ["nearest layouts that fit (each from this one):",
            *(f"  {flags}: needs {format_bytes(est.needed_bytes)} ({100 * est.needed_bytes / args.gpu_memory:.0f}%)"
              for flags, est in found)]


class FitCheck(NamedTuple):
    """The planner's answer for one command line (``check_fit``)."""

    name: str  # the model, as the output's first line names it
    estimate: MemoryEstimate  # the layout's estimate; ``estimate.fits`` is the verdict
    fitting: list[tuple[str, MemoryEstimate]]  # when it does not fit (and asked): (flags, estimate) that do


def check_fit(argv: Sequence[str], *, suggest: bool = True) -> FitCheck:
    """What ``python -m fsdp2.plan ARGV`` decides, as values: the estimate, and the nearest layouts
    that fit when it does not (``suggest``; their flags are this command line's).

    ``argv`` must give ``--gpu-memory``. Raises ValueError for a command line the CLI would refuse.
    Runs the simulation on a fake process group: call it before ``init_process_group``, in a
    process that does not train afterwards (see ``estimate_memory``).
    """
    parser = _parser()
    try:
        args = _parse(parser, argv)
    except SystemExit:  # argparse's own errors: say them as a ValueError
        raise ValueError(f"python -m fsdp2.plan {' '.join(argv)}: not a valid command line") from None
    if args.gpu_memory is None:
        raise ValueError("check_fit needs --gpu-memory: the bytes per rank to compare with")
    _name, model, _notes = _model_args(args)
    layout = _layout(args)
    est = _estimate(args, model, layout)
    fitting = _fitting(args, model, layout) if suggest and not est.fits else []
    return FitCheck(_name, est, fitting)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        if (profile := _time_cli.calibrate_command(parser, argv)) is not None:
            print(profile)
            return 0
        args = _parse(parser, argv)
        name, model, notes = _model_args(args)
        if args.search:
            print(search_report(args, name=name, model=model, param_dtype=DTYPES[args.param_dtype],
                                reserve=_reserve(args)))
            return 0
        layout = _layout(args)
        if args.compare:
            print(f"{name}, world {args.world}, batch {args.batch} x seq {args.seq}, "
                  f"param {args.param_dtype}, optimizer {args.optimizer}")
            print(_compare(args, model))
            return 0
        est = _estimate(args, model, layout)
        print(f"{name}: {est.table()}")
        if args.gpu_memory is not None and (read := args.gpu_memory.note("--gpu-memory")):
            notes.append(read)
        for note in notes + est.notes:
            print(f"note: {note}")
        if est.fits is False:
            print("\n".join(_suggest(args, model, layout)))
        if (timed := _time_cli.time_report(args, model, layout)) is not None:
            print(timed)
    except ValueError as e:
        parser.error(str(e))
    return 0
